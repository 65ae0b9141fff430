"""``TransactionalSync`` on two trainer ranks (TP=2, gloo) against real embedded servers: every rank gets the same
per-engine report; an engine down during the sync fails at stage while the other commits; when none commits, every
rank raises one error naming engine, phase and cause; a server SIGSTOPped in the middle of a distributed (gloo)
broadcast ends the sync within its deadline, the broadcast aborted, on both ranks; a trainer rank stalled inside the
sync: the sender fails at the deadline naming it (the trainer's group is ended), the stalled rank fails when it wakes."""

from __future__ import annotations

import pytest

from multiproc import run_distributed, tiny_hf_checkpoint

import model_helpers  # noqa: F401  (its warning filters quiet known Megatron noise in the ranks)

ATOL = 1e-4
DEADLINE_S = 6.0


def _child(path):
    import os
    import signal
    import time

    import torch
    import torch.distributed as dist

    from megatron_rl import parallel
    from megatron_rl.models.build import build_model
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.rollout.client.balancer import RemoteEngine
    from megatron_rl.rollout.client.http_client import RetryPolicy, SGLangClient
    from megatron_rl.rollout.client.process import launch_embedded_server
    from megatron_rl.rollout.embedded.engine import EmbeddedEngine
    from megatron_rl.rollout.embedded.server import EmbeddedServer
    from megatron_rl.weights.sync import WeightSyncConfig
    from megatron_rl.weights.transactional_sync import TransactionalSync

    sender = dist.get_rank() == 0
    built = build_model(ModelConfig(hf_path=path), parallel.init_megatron_parallel(parallel.ParallelLayout(tp=2)))
    with torch.no_grad():
        for p in built.module.parameters():
            p.mul_(1.0 + 0.1 * torch.cos(7.0 * p))
    cfg = WeightSyncConfig(bucket_mb=0.03, progress=False, timeout_s=DEADLINE_S)
    fast = RetryPolicy(max_attempts=2, backoff_s=0.05)
    servers = [EmbeddedServer(EmbeddedEngine.from_pretrained(path)).start() for _ in range(2)] if sender else []
    engine = RemoteEngine([SGLangClient(s.url, retry=fast) for s in servers], weight_transport="tensor") \
        if sender else None
    sync = TransactionalSync(built, engine, cfg)
    out = {}

    def attempt(version):
        start = time.monotonic()
        try:
            stats = sync.sync(version)
            r = stats.transaction
            return ("ok", r.committed, [(f.index, f.phase, f.cause) for f in r.failures], stats.check.max_abs_diff,
                    r.metrics(), time.monotonic() - start)
        except Exception as e:  # noqa: BLE001
            return ("error", type(e).__name__, str(e), time.monotonic() - start)

    proc = None
    try:
        out["clean"] = attempt("t1")
        out["versions"] = [s.engine.weight_version for s in servers]
        if sender:
            servers[1].stop()  # down for the whole sync: refused at once
        out["one_down"] = attempt("t2")
        out["versions_after"] = [servers[0].engine.weight_version] if sender else []
        if sender:
            servers[0].stop()
        out["none"] = attempt("t3")
        # the distributed transport, one server in its own process, SIGSTOPped once the first bucket is announced
        if sender:
            proc = launch_embedded_server(path, os.path.join(path, "server.log"))
            remote = RemoteEngine([SGLangClient(proc.url, retry=fast)], weight_transport="distributed")
            remote.init_weight_sync("127.0.0.1", 0, backend="gloo", timeout_s=60)
        dsync = TransactionalSync(built, remote if sender else None, cfg)
        stats = dsync.sync("d0")  # a clean broadcast: each bucket's checksum verified by the server
        out["distributed"] = (stats.transaction.committed, stats.check.max_abs_diff,
                              remote.clients[0].get_weight_version() if sender else None)
        if sender:
            announce = remote.clients[0].update_weights_from_distributed

            def stop_then_announce(*args, **kwargs):
                os.kill(proc.proc.pid, signal.SIGSTOP)
                return announce(*args, **kwargs)
            remote.clients[0].update_weights_from_distributed = stop_then_announce
        dist.barrier()  # rank 1's clock starts with rank 0's sync, not during the server's start-up
        start = time.monotonic()
        try:
            dsync.sync("d1")
            out["stopped"] = None
        except Exception as e:  # noqa: BLE001
            out["stopped"] = (type(e).__name__, str(e), time.monotonic() - start)
        # last (it ends the trainer's group): rank 1 stalls inside the sync, before sending its pieces
        if not sender:
            from megatron_rl.weights import links

            send = links.send_pieces
            links.send_pieces = lambda *a, **k: (time.sleep(DEADLINE_S + 4.0), send(*a, **k))[1]
        if sender:
            servers[1:] = [EmbeddedServer(EmbeddedEngine.from_pretrained(path)).start()]
            engine.clients[1] = engine.clients[1].with_url(servers[1].url)
        dist.barrier()
        out["trainer_stalled"] = attempt("s1")
    finally:
        if proc is not None:
            os.kill(proc.proc.pid, signal.SIGCONT)
            proc.stop()
        for s in servers[1:]:
            s.stop()
    return out


@pytest.mark.timeout(300)
def test_transactional_sync_per_engine_outcomes_on_every_rank(tmp_path):
    path = tiny_hf_checkpoint(str(tmp_path / "qwen3"), "qwen3")
    r0, r1 = run_distributed(_child, 2, path, timeout_s=280)
    for k in ("clean", "one_down", "none", "distributed", "stopped", "trainer_stalled"):
        print(f"\n{k}: rank 0 {r0[k]}\n   rank 1 {r1[k]}")
    for r in (r0, r1):
        kind, committed, failures, diff, metrics, _ = r["clean"]
        assert (kind, committed, failures) == ("ok", [0, 1], []) and diff <= ATOL
        assert metrics["sync/engines_committed"] == 2.0 and metrics["sync/aborted"] == 0.0
        kind, committed, failures, diff, metrics, seconds = r["one_down"]
        assert (kind, committed) == ("ok", [0]) and diff <= ATOL and seconds < DEADLINE_S
        assert [(i, phase) for i, phase, _ in failures] == [(1, "stage")], failures
        assert "ServerUnavailableError" in failures[0][2]
        assert metrics["sync/engines_failed"] == 1.0
    assert r0["versions"] == ["t1", "t1"] and r0["versions_after"] == ["t2"]
    kind, name, message, seconds = r0["none"]
    assert (kind, name) == ("error", "TransactionError") and seconds < DEADLINE_S
    assert "no engine committed" in message and "engine 0 (http://" in message and "failed at stage" in message
    assert r1["none"][1] == "WeightSyncError" and "TransactionError" in r1["none"][2]
    assert r0["distributed"][0] == [0] and r0["distributed"][1] <= ATOL and r0["distributed"][2] == "d0"
    assert r1["distributed"][0] == [0]
    name, message, seconds = r0["stopped"]
    # the patched announce keeps the client's own (long) timeout: the sync deadline itself ends the broadcast
    assert name == "TransactionError" and "engine 0 (http://" in message and "failed at stage" in message, message
    assert "ran past the deadline of 6.0 s" in message
    assert seconds < DEADLINE_S + 3.0, seconds
    assert r1["stopped"] is not None and r1["stopped"][2] < DEADLINE_S + 3.0
    kind, name, message, seconds = r0["trainer_stalled"]
    assert (kind, name) == ("error", "TrainerStalled") and "trainer rank 1 did not send its piece" in message
    assert DEADLINE_S - 0.5 < seconds < DEADLINE_S + 2.0, seconds  # at the deadline, not when rank 1 wakes
    assert r1["trainer_stalled"][0] == "error" and r1["trainer_stalled"][3] < DEADLINE_S + 4.0 + 5.0
