"""Engine recovery with real embedded servers in child processes (``EngineWorker`` without Ray): the balancer
re-sends the requests of a SIGKILLed or SIGSTOPped (hung) server, the monitor restarts it on a fresh port,
gives it the "trainer's" weights and re-admits it after the probe check; seeded answers equal an
uninterrupted server's; holds defer restarts; a server that keeps dying ends in one clear error."""

import contextlib
import dataclasses
import os
import signal
import threading
import time

import pytest
import torch

from megatron_rl.config import RecoveryConfig
from megatron_rl.orchestration.engine_health import EngineMonitor, EngineRecoveryError
from megatron_rl.orchestration.engine_worker import EngineSpec, EngineWorker
from megatron_rl.rollout.client.balancer import RemoteEngine
from megatron_rl.rollout.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
from megatron_rl.rollout.client.http_client import RetryPolicy, SGLangClient
from megatron_rl.rollout.client.protocol import GenerateRequest, SamplingParams
from megatron_rl.rollout.client.protocol import derive_seed
from megatron_rl.weights.sync import compare_logprobs

from fault_hooks import kill_plan
from rollout_models import other_weights, tiny_qwen3

FAST = RetryPolicy(max_attempts=2, backoff_s=0.05)
REQUESTS = [GenerateRequest((5 + i, 6, 7), SamplingParams(max_new_tokens=6, seed=100 + i, n=2, ignore_eos=True))
            for i in range(8)]
PROBE = list(range(1, 40))
QUICK = dict(poll_s=0.2, stall_s=1.0, health_timeout_s=2.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3")
    tiny_qwen3().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def trained():
    """The "trainer's" weights (not the checkpoint the servers start from), the samples they give REQUESTS (the
    client sends a request's n samples as n one-sample batch items with derived seeds) and PROBE's log-probs."""
    engine = EmbeddedEngine(tiny_qwen3(seed=1), EmbeddedEngineConfig(seeds="deterministic"))
    samples = [[engine.generate([GenerateRequest(r.prompt_ids, dataclasses.replace(
        r.sampling, n=1, seed=derive_seed(r.sampling.seed, j)))])[0] for j in range(r.sampling.n)] for r in REQUESTS]
    return other_weights(tiny_qwen3, seed=1), samples, engine.prompt_logprobs(PROBE)[0]


class Trainer:
    """Stands in for TrainerGroup.sync_engine: pushes the weights to one server and runs the probe check."""

    def __init__(self, trained):
        self.weights, _, self.probe_lp = trained
        self.synced = []

    def __call__(self, index: int, url: str) -> str:
        engine = RemoteEngine([SGLangClient(url, retry=FAST)])
        try:
            engine.update_weights([self.weights], version="v1")
            check = compare_logprobs(self.probe_lp, engine.prompt_logprobs(PROBE)[0].float(), 1e-4,
                                     torch.tensor(PROBE))
        finally:
            engine.shutdown()
        self.synced.append((index, url))
        return f"probe max |dlogp| {check.max_abs_diff:.1e}"


@contextlib.contextmanager
def _watched(model_dir, tmp_path, trained, servers: int, max_restarts: int):
    """``servers`` embedded servers holding the trained weights, a balancer over them and a running monitor."""
    workers = [EngineWorker(EngineSpec(kind="embedded", model_path=model_dir, index=i, log_dir=str(tmp_path)))
               for i in range(servers)]
    engine = monitor = None
    try:
        urls = [w.start() for w in workers]
        engine = RemoteEngine([SGLangClient(u, retry=FAST) for u in urls])
        engine.update_weights([trained[0]], version="v1")
        trainer = Trainer(trained)
        monitor = EngineMonitor(engine, workers, trainer, RecoveryConfig(max_restarts=max_restarts, **QUICK)).start()
        yield workers, engine, monitor, trainer
    finally:
        if monitor is not None:
            monitor.stop()
        if engine is not None:
            engine.shutdown()
        for w in workers:
            w.stop()


def _in_flight(engine, server: int):
    """REQUESTS generated in the background, once at least two wait on ``server`` (paused in place: provably in
    flight). Returns (thread, out) where out gets "samples" or "error"."""
    engine.clients[server].pause_generation(mode="in_place")
    out = {}

    def run():
        try:
            out["samples"] = engine.generate(REQUESTS)
        except Exception as e:  # noqa: BLE001
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    _wait_for(lambda: engine.outstanding[server] >= 2, what=f"requests on server {server}")
    return thread, out


def _wait_for(cond, timeout=120.0, what=""):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _assert_reference(thread, out, trained):
    thread.join(180)
    assert "error" not in out, out.get("error")
    expected = [s for group in trained[1] for s in group]
    assert len(out["samples"]) == len(expected) == sum(r.sampling.n for r in REQUESTS)
    for got, want in zip(out["samples"], expected):
        assert got.response_ids == want.response_ids
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5)
        assert got.weight_version == "v1"


def test_killed_and_hung_servers_are_restarted_resynced_and_their_requests_resent(model_dir, tmp_path, trained):
    with _watched(model_dir, tmp_path, trained, servers=2, max_restarts=1) as (workers, engine, monitor, trainer):
        urls = [c.url for c in engine.clients]
        # 1. kill -9 server 0 with requests on it: they go to server 1; server 0 comes back at a new URL
        thread, out = _in_flight(engine, 0)
        workers[0].kill()
        _assert_reference(thread, out, trained)
        assert engine.resent[0] >= 2 and engine.resent[1] == 0
        _wait_for(lambda: monitor.restarts == 1 and all(engine.available), what="server 0 back")
        assert trainer.synced == [(0, engine.clients[0].url)] and engine.clients[0].url != urls[0]
        assert workers[0].exit_status() is None and engine.clients[0].get_weight_version() == "v1"

        # 2. server 1 hangs (SIGSTOP) with requests on it: no answer for stall_s -> /health times out -> restarted
        thread, out = _in_flight(engine, 1)
        os.kill(workers[1].process.proc.pid, signal.SIGSTOP)
        _assert_reference(thread, out, trained)
        _wait_for(lambda: monitor.restarts == 2 and all(engine.available), what="server 1 back")
        assert [i for i, _ in trainer.synced] == [0, 1] and engine.clients[1].url != urls[1]
        assert monitor.metrics()["engine/restarts"] == 2.0 and monitor.metrics()["engine/out_seconds"] > 0

        # 3. server 0 dies again: max_restarts=1 within the window -> one error naming it, with its log tail
        workers[0].kill()
        _wait_for(lambda: monitor.error is not None, what="the monitor to give up")
        message = str(monitor.error)
        assert "engine 0" in message and "exited with code -9 (SIGKILL)" in message
        assert "rollout.recovery.max_restarts=1" in message and "embedded_0.log" in message
        assert "embedded server listening" in message  # the log tail itself
        with pytest.raises(EngineRecoveryError, match="engine 0"):
            monitor.raise_if_failed()
        assert engine.generate(REQUESTS[:2])  # server 1 still serves


def test_single_server_requests_wait_for_the_restart_which_waits_for_the_hold(model_dir, tmp_path, trained):
    with _watched(model_dir, tmp_path, trained, servers=1, max_restarts=1) as (workers, engine, monitor, trainer):
        # the only server dies with requests in flight during a hold (the driver released its memory, say):
        # the exit is seen at once, the restart waits for the hold's end, the requests wait for the restart
        thread, out = _in_flight(engine, 0)
        hold = monitor.hold("test")
        workers[0].kill()
        _wait_for(lambda: not engine.available[0], what="the exit to be seen")
        time.sleep(1.0)
        assert monitor.restarts == 0 and thread.is_alive()
        hold.release()
        _assert_reference(thread, out, trained)
        assert monitor.restarts == 1 and engine.resent[0] >= 2 and trainer.synced == [(0, engine.clients[0].url)]

        # it dies again past max_restarts: the waiting requests raise the monitor's error
        thread, out = _in_flight(engine, 0)
        workers[0].kill()
        thread.join(180)
        assert isinstance(out.get("error"), EngineRecoveryError), out
        assert "engine 0" in str(out["error"]) and "max_restarts=1" in str(out["error"])


def test_a_restarted_server_failing_its_probe_stays_out_until_one_passes(model_dir, tmp_path, trained):
    """Re-admission is gated by the probe check: a restarted server whose probe fails (its weights are not the
    trainer's) is restarted again, never put back in rotation, and serves nothing until a probe passes."""
    from megatron_rl.weights.sync import WeightMismatchError

    with _watched(model_dir, tmp_path, trained, servers=2, max_restarts=3) as (workers, engine, monitor, trainer):
        failed = []
        sync = trainer.__call__

        def first_probe_fails(index, url):
            if not failed:
                failed.append((url, engine.available[index], engine.clients[index].url))
                raise WeightMismatchError("weight sync check failed (test): the engine's weights are not the "
                                          "trainer's")
            return sync(index, url)

        monitor.resync = first_probe_fails
        thread, out = _in_flight(engine, 0)
        workers[0].kill()
        _assert_reference(thread, out, trained)  # everything answered by server 1, as the reference would
        _wait_for(lambda: monitor.restarts == 2 and all(engine.available), what="server 0 back")
        (bad_url, available, client_url), = failed
        assert not available and client_url != bad_url  # while its probe failed it was out, not yet swapped in
        assert trainer.synced == [(0, engine.clients[0].url)] and engine.clients[0].url != bad_url
        assert engine.resent[0] >= 2 and monitor.metrics()["engine/restarts"] == 2.0


def test_kill_plan_parses_and_rejects():
    assert kill_plan("2:0, 2:1,3:0,1:1:sync") == {(2, "rollout"): [0, 1], (3, "rollout"): [0], (1, "sync"): [1]}
    assert kill_plan(None) == {} and kill_plan("") == {}
    for bad in ("2", "2:x", "2:0:train", "1:2:3:4"):
        with pytest.raises(ValueError, match=f"MEGATRON_RL_TEST_KILL_ENGINE='{bad}'"):
            kill_plan(bad)


def test_server_errors_survive_pickling():
    """Ray sends a failed actor call's exception to the driver pickled (an unpicklable one: "Failed to deserialize")."""
    import pickle

    from megatron_rl.rollout.client.http_client import RequestRejected, ServerUnavailableError

    for cls in (ServerUnavailableError, RequestRejected):
        e = pickle.loads(pickle.dumps(cls("boom", "http://h:1", 400, {"a": 1})))
        assert (type(e), str(e), e.url, e.status, e.payload) == (cls, "boom", "http://h:1", 400, {"a": 1})


def test_recovery_config_rejects_bad_values():
    with pytest.raises(ValueError, match="rollout.recovery.poll_s=0"):
        RecoveryConfig(poll_s=0)
    with pytest.raises(ValueError, match="rollout.recovery.max_restarts=-1"):
        RecoveryConfig(max_restarts=-1)


def test_trainer_group_submits_each_collective_call_to_every_rank_in_one_order():
    """The recovery thread's sync_engine and the driver's calls run concurrently: every rank's actor must see the
    calls in the same order (a collective entered in different orders deadlocks)."""
    import sys

    ray = pytest.importorskip("ray")
    from megatron_rl.orchestration.trainer_group import TrainerGroup

    class Rank:
        def __init__(self):
            self.seen = []

        def record(self, tag):
            self.seen.append(tag)

        def sync_engine(self, index, url, version):
            self.seen.append(f"sync{index}@{version}")

        def log(self):
            return self.seen

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    interval = sys.getswitchinterval()
    try:
        ranks = [ray.remote(Rank).options(num_cpus=0).remote() for _ in range(4)]
        group = TrainerGroup(ranks)
        sys.setswitchinterval(1e-6)  # thread switches inside the submission loops, if nothing prevents them
        threads = [threading.Thread(target=lambda: [group._call("record", f"a{k}") for k in range(150)]),
                   threading.Thread(target=lambda: [group.sync_engine(k % 2, "u") for k in range(150)])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sys.setswitchinterval(interval)
        logs = ray.get([r.log.remote() for r in ranks])
        assert len(logs[0]) == 300 and all(log == logs[0] for log in logs)
    finally:
        sys.setswitchinterval(interval)
        ray.shutdown()
