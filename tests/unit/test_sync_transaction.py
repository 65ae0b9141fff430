"""The weight-sync transaction over two real embedded servers in child processes (``EngineWorker`` without Ray):
stage -> verify -> commit with per-engine failures. Each chaos case -- a server killed mid-bucket, a server
SIGSTOPped mid-bucket, a bucket corrupted in transit (the server's checksum refuses it), a refused
``begin_weight_update`` -- ends within the deadline with the healthy server committed (new weights, new version) and
the failed one named with its phase and cause, its version never flipped; the engine monitor then takes it out of
rotation, restarts it and re-admits it after its own verified sync."""

import contextlib
import os
import signal
import time

import pytest
import torch

from megatron_rl.config import RecoveryConfig
from megatron_rl.orchestration.engine_health import EngineMonitor
from megatron_rl.orchestration.engine_worker import EngineSpec, EngineWorker
from megatron_rl.orchestration.sync_failures import handle_failed_engines
from megatron_rl.rollout.client.balancer import RemoteEngine
from megatron_rl.rollout.client.http_client import RetryPolicy, SGLangClient
from megatron_rl.rollout.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
from megatron_rl.weights.checksum import bucket_checksum, bytes_checksum, verify
from megatron_rl.weights.deadline import Deadline, SyncTimeout, Watchdog, default_timeout_s
from megatron_rl.weights.probe import compare_logprobs
from megatron_rl.weights.sync import SyncStats, iter_buckets
from megatron_rl.weights.transaction import TransactionError

from rollout_models import other_weights, tiny_qwen3

pytestmark = pytest.mark.timeout(300)
FAST = RetryPolicy(max_attempts=2, backoff_s=0.05)
PROBE = list(range(1, 40))
BUCKET = 24 << 10  # ~15 buckets for the tiny model
DEADLINE_S = 8.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3")
    tiny_qwen3().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def trained():
    """The "trainer's" weights and their probe log-probs (float64 reference not needed: the same fp32 model)."""
    weights = other_weights(tiny_qwen3, seed=1)
    engine = EmbeddedEngine(tiny_qwen3(seed=1), EmbeddedEngineConfig(seeds="deterministic"))
    return weights, engine.prompt_logprobs(PROBE)[0].float()


class CorruptingClient(SGLangClient):
    """Fault hook: flips the values of one tensor of bucket ``at`` after the sender checksummed it."""

    at = 2

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent = [0]  # shared by the per-call copies the transaction makes

    def update_weights_from_tensor(self, buckets, checksums=None):
        buckets = [list(b) for b in buckets]
        self.sent[0] += 1
        if self.sent[0] - 1 == self.at:
            name, t = buckets[0][0]
            buckets[0][0] = (name, -t)
        return super().update_weights_from_tensor(buckets, checksums)

    def with_url(self, url):
        return SGLangClient(url, self.timeout_s, self.retry)


class RefusingClient(SGLangClient):
    """Fault hook: its server refuses ``begin_weight_update`` (a real HTTP 404 of a real server)."""

    def begin_weight_update(self):
        self._expect_success(self.request("POST", "/begin_weight_update_refused", {}))

    def with_url(self, url):
        return SGLangClient(url, self.timeout_s, self.retry)


@contextlib.contextmanager
def _servers(model_dir, tmp_path, client_cls=SGLangClient):
    workers = [EngineWorker(EngineSpec(kind="embedded", model_path=model_dir, index=i, log_dir=str(tmp_path)))
               for i in range(2)]
    engine = None
    try:
        urls = [w.start() for w in workers]
        engine = RemoteEngine([SGLangClient(urls[0], retry=FAST), client_cls(urls[1], retry=FAST)])
        yield workers, engine
    finally:
        if engine is not None:
            engine.shutdown()
        for w in workers:
            os.kill(w.process.proc.pid, signal.SIGCONT) if w.exit_status() is None else None
            w.stop()


def _transaction(engine, weights, reference, fault=None, deadline_s=DEADLINE_S):
    """Stage (calling ``fault()`` after the first bucket), verify against ``reference``, commit; returns
    (report, seconds)."""
    start = time.monotonic()
    txn = engine.begin_transaction("v1", deadline_s)

    def buckets():
        for k, bucket in enumerate(iter_buckets(weights, BUCKET)):
            yield bucket
            if k == 0 and fault is not None:
                fault()
    engine.stage_weights(buckets(), txn)
    for i, lp in engine.probe_each(txn, PROBE).items():
        try:
            compare_logprobs(reference, torch.as_tensor(lp).float(), 1e-4, torch.tensor(PROBE), f"engine {i}")
        except Exception as e:  # noqa: BLE001
            txn.fail(i, "verify", e)
    engine.commit_weights(txn)
    return txn.report, time.monotonic() - start


def _assert_one_committed(engine, report, seconds, trained, phase, cause):
    print(f"\n{phase}: {report.failures[0].describe() if report.failures else None}; {seconds:.2f} s "
          f"(deadline {DEADLINE_S} s)")
    assert seconds < DEADLINE_S + 2.0
    assert report.committed == [0] and [(f.index, f.phase) for f in report.failures] == [(1, phase)]
    assert cause in report.failures[0].cause, report.failures[0].cause
    assert engine.clients[0].get_weight_version() == "v1"
    lp = engine.clients[0].prompt_logprobs(PROBE).float()
    assert compare_logprobs(trained[1], lp, 1e-4, torch.tensor(PROBE), "engine 0").max_abs_diff <= 1e-4
    m = report.metrics()
    assert (m["sync/engines_committed"], m["sync/engines_failed"]) == (1.0, 1.0)
    assert m["sync/phase_seconds/stage"] > 0 and m["sync/phase_seconds/commit"] > 0


def test_uninterrupted_transaction_commits_every_engine(model_dir, tmp_path, trained):
    with _servers(model_dir, tmp_path) as (workers, engine):
        report, seconds = _transaction(engine, trained[0], trained[1])
        assert report.committed == [0, 1] and not report.failures and not report.aborted, report
        assert [c.get_weight_version() for c in engine.clients] == ["v1", "v1"]
        # a probe that matches no engine: nothing commits, versions stay
        txn = engine.begin_transaction("v2", DEADLINE_S)
        engine.stage_weights(iter_buckets(trained[0], BUCKET), txn)
        for i in engine.probe_each(txn, PROBE):
            txn.fail(i, "verify", "probe differs (test)")
        assert engine.commit_weights(txn) == []
        with pytest.raises(TransactionError, match=r"engine 0 \(http://.*\) failed at verify: probe differs"):
            txn.raise_if_none_alive("verify")
        assert [c.get_weight_version() for c in engine.clients] == ["v1", "v1"]


def test_engine_killed_mid_bucket(model_dir, tmp_path, trained):
    with _servers(model_dir, tmp_path) as (workers, engine):
        report, seconds = _transaction(engine, trained[0], trained[1], fault=workers[1].kill)
        _assert_one_committed(engine, report, seconds, trained, "stage", "ServerUnavailableError")


def test_engine_sigstopped_mid_bucket(model_dir, tmp_path, trained):
    with _servers(model_dir, tmp_path) as (workers, engine):
        stop = lambda: os.kill(workers[1].process.proc.pid, signal.SIGSTOP)  # noqa: E731
        report, seconds = _transaction(engine, trained[0], trained[1], fault=stop)
        _assert_one_committed(engine, report, seconds, trained, "stage", "no answer within")
        assert seconds >= DEADLINE_S * 0.25  # it waited one call's share of the deadline, not more than the whole


def test_corrupted_bucket_refused_by_its_checksum(model_dir, tmp_path, trained):
    with _servers(model_dir, tmp_path, CorruptingClient) as (workers, engine):
        report, seconds = _transaction(engine, trained[0], trained[1])
        _assert_one_committed(engine, report, seconds, trained, "stage", "bucket checksum mismatch")
        assert engine.clients[1].get_weight_version() != "v1"  # never flipped


def test_refused_begin_then_out_of_rotation_restarted_and_readmitted_after_verified_sync(model_dir, tmp_path,
                                                                                          trained):
    """A refused ``begin_weight_update``; then what the driver does with the report: the monitor takes engine 1 out
    at once, restarts it and re-admits it only after its own sync passed the probe; without a monitor, one error
    naming engine, phase and cause."""
    synced = []

    def resync(index, url):
        one = RemoteEngine([SGLangClient(url, retry=FAST)])
        try:
            one.update_weights([trained[0]], version="v1")
            check = compare_logprobs(trained[1], one.prompt_logprobs(PROBE)[0].float(), 1e-4, torch.tensor(PROBE))
        finally:
            one.shutdown()
        synced.append(index)
        return f"probe max |dlogp| {check.max_abs_diff:.1e}"

    with _servers(model_dir, tmp_path, RefusingClient) as (workers, engine):
        report, seconds = _transaction(engine, trained[0], trained[1])
        _assert_one_committed(engine, report, seconds, trained, "stage", "begin_weight_update_refused")
        assert engine.clients[1].get_weight_version() != "v1"
        stats = SyncStats(version="v1", seconds=0, transfer_seconds=0, gather_seconds=0, bytes=0, buckets=0,
                          tensors=0, dtype="float32", transaction=report)
        with pytest.raises(TransactionError, match=r"engine 1 \(http://.*\) failed at stage: .*refused.* 404"):
            handle_failed_engines(stats, None)
        monitor = EngineMonitor(engine, workers, resync, RecoveryConfig(max_restarts=2, poll_s=0.2, stall_s=1.0,
                                                                        health_timeout_s=2.0)).start()
        try:
            old = engine.clients[1].url
            metrics = handle_failed_engines(stats, monitor)
            assert metrics["sync/engines_failed"] == 1.0 and metrics["sync/engines_committed"] == 1.0
            assert not engine.available[1]  # out of rotation at once
            deadline = time.monotonic() + 120
            while not (monitor.restarts == 1 and all(engine.available)):
                assert time.monotonic() < deadline and monitor.error is None, monitor.error
                time.sleep(0.05)
            assert synced == [1] and engine.clients[1].url != old
            assert engine.clients[1].get_weight_version() == "v1"
        finally:
            monitor.stop()


def test_checksum_deadline_and_watchdog_units():
    a = torch.arange(10, dtype=torch.float32)
    bucket = [("a", a), ("b", torch.ones(3, dtype=torch.bfloat16))]
    s = bucket_checksum(bucket)
    verify(bucket, s)
    verify([bucket[1], bucket[0]], s)  # name order: the order a safetensors file returns does not matter
    for changed in ([("a", a.flip(0)), bucket[1]], [("a", a + 1e-6), bucket[1]], [("c", a), bucket[1]]):
        with pytest.raises(ValueError, match="bucket checksum mismatch"):
            verify(changed, s)
    with pytest.raises(ValueError, match="two integers"):
        verify(bucket, [1.5, 2])
    # exact integers: the same on any device / reduction order; chunking changes nothing
    big = torch.randint(0, 256, (2 * 3 + 1,), dtype=torch.uint8)
    words = torch.cat([big, big.new_zeros(1)]).view(torch.int16).to(torch.int64)
    pos = torch.arange(words.numel()) % 65521 + 1
    assert bytes_checksum(big) == [int(words.sum()), int((words * pos).sum())]

    from megatron_rl.weights.sync import WeightSyncConfig

    for bad in (0, -1.0, float("nan"), "10"):
        with pytest.raises(ValueError, match=r"weight_sync.timeout_s=.*expected seconds > 0"):
            WeightSyncConfig(timeout_s=bad)
    assert WeightSyncConfig(timeout_s=30).timeout_s == 30
    assert default_timeout_s(10**9) == 120.0 and default_timeout_s(10**11, gb_per_s=2.0) == 500.0
    d = Deadline(0.2, "test sync")
    assert d.call_bound() == pytest.approx(0.05) and d.call_bound(0.01) == pytest.approx(0.01)  # a quarter; a shorter own timeout wins
    time.sleep(0.25)
    with pytest.raises(SyncTimeout, match="test sync: the stage phase ran past the deadline of 0.2 s"):
        d.check("stage")
    fired = []
    with Watchdog(Deadline(0.1), lambda: fired.append(1), "a collective") as dog:
        time.sleep(0.3)
    assert dog.fired and fired == [1]
    with Watchdog(Deadline(5.0), lambda: fired.append(2), "a collective") as dog:
        pass
    assert not dog.fired and fired == [1]
