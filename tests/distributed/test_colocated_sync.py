"""Colocated SGLang's trainer side on CPU (gloo, 2 ranks): the ``ipc`` weight transport into embedded servers
that speak SGLang's ``/update_weights_from_tensor`` format (shared-memory files stand in for CUDA-IPC
handles), and the trainer offload (optimizer state + gradient buffers out and back).

* one server of TP 2 (``--tp-size 2``): both ranks encode their own copy, rank 0 gathers and posts the two
  payloads; a server that refuses (weights released) fails the sync on both ranks and leaves no session open;
* two servers of TP 1: each rank is the leader of its own engine (``load_format`` None);
* offload: after it every optimizer-state and gradient-buffer storage is empty, the parameters untouched;
  after reload, steps are bitwise those of a trainer never offloaded (distributed and plain optimizer).
"""

from __future__ import annotations

import math

import pytest
import torch

from multiproc import run_distributed, tiny_hf_checkpoint

import model_helpers  # noqa: F401  (its warning filters quiet known Megatron noise in the ranks)

ATOL = 1e-4
BUCKET_MB = 0.03  # ~31 KB: several buckets for the tiny model


def _perturb(built, scale: float) -> None:
    with torch.no_grad():
        for p in built.module.parameters():
            p.mul_(1.0 + scale * torch.cos(7.0 * p))


def _ipc_child(path, tp2_url, tp1_urls):
    import torch.distributed as dist

    from megatron_rl import parallel
    from megatron_rl.models import mapping
    from megatron_rl.models.build import build_model
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.rollout.client.balancer import RemoteEngine
    from megatron_rl.rollout.client.http_client import RetryPolicy, SGLangClient
    from megatron_rl.rollout.client.ipc_transport import IpcTransport
    from megatron_rl.weights.sync import WeightSync, WeightSyncConfig

    rank = dist.get_rank()
    groups = parallel.init_megatron_parallel(parallel.ParallelLayout())  # DP=2
    built = build_model(ModelConfig(hf_path=path), groups)
    cfg = WeightSyncConfig(bucket_mb=BUCKET_MB, progress=False)
    retry = RetryPolicy(max_attempts=2, backoff_s=0.05)

    def engine(urls):  # rank 0: the check's (and the test driver's) view of the servers
        return RemoteEngine([SGLangClient(u, retry=retry) for u in urls]) if rank == 0 else None

    out = {"expected": (len(mapping.hf_shapes(built.arch)),
                        4 * sum(math.prod(s) for s in mapping.hf_shapes(built.arch).values()))}
    ipc = IpcTransport([tp2_url], retry=retry)
    out["tp2_layout"] = (ipc.tp_sizes, ipc.ranks, ipc.is_leader)
    sync = WeightSync(built, engine([tp2_url]), cfg, transport=ipc)
    _perturb(built, 0.1)
    stats = sync.sync(version="a1")
    out["tp2"] = (stats.tensors, stats.bytes, stats.buckets, stats.check.max_abs_diff)
    # the server refuses: its weights are released (a driver that forgot to resume them)
    if rank == 0:
        sync.engine.release_memory(["weights"])
    _perturb(built, 0.05)
    try:
        sync.sync(version="a2")
        out["refused"] = None
    except Exception as e:  # noqa: BLE001
        out["refused"] = (type(e).__name__, str(e))
    if rank == 0:
        client = sync.engine.clients[0]
        client.begin_weight_update()  # no session was left open by the failed sync
        client.end_weight_update()
        out["version_after_refusal"] = client.get_weight_version()
        sync.engine.resume_memory(["weights"])
    stats = sync.sync(version="a3")
    out["recovered"] = stats.check.max_abs_diff
    if rank == 0:
        out["tp2_version"] = sync.engine.clients[0].get_weight_version()
    # two engines of TP 1: every rank leads its own, plain named tensors
    ipc = IpcTransport(tp1_urls, load_format=None, retry=retry)
    out["tp1_layout"] = (ipc.tp_sizes, ipc.ranks, ipc.is_leader)
    sync = WeightSync(built, engine(tp1_urls), cfg, transport=ipc)
    _perturb(built, 0.1)
    stats = sync.sync(version="b1")
    out["tp1"] = (stats.tensors, stats.check.max_abs_diff)
    if rank == 0:
        out["tp1_versions"] = [c.get_weight_version() for c in sync.engine.clients]
    return out


@pytest.mark.timeout(300)
def test_ipc_transport_into_sglang_format_servers(tmp_path):
    """The servers run in this (the parent) process: another process than every payload's producer."""
    from megatron_rl.rollout.embedded.engine import EmbeddedEngine
    from megatron_rl.rollout.embedded.server import EmbeddedServer

    path = tiny_hf_checkpoint(str(tmp_path / "qwen3"), "qwen3")
    servers = [EmbeddedServer(EmbeddedEngine.from_pretrained(path), tp_size=tp).start() for tp in (2, 1, 1)]
    try:
        r0, r1 = run_distributed(_ipc_child, 2, path, servers[0].url, [s.url for s in servers[1:]], timeout_s=260)
    finally:
        for s in servers:
            s.stop()
    tensors, nbytes = r0["expected"]
    assert r0["tp2_layout"] == ([2], [0, 1], True) and r1["tp2_layout"] == ([2], [0, 1], False)
    assert r0["tp1_layout"] == ([1, 1], [0], True) and r1["tp1_layout"] == ([1, 1], [1], True)
    n, b, buckets, diff = r0["tp2"]
    assert (n, b) == (tensors, nbytes) and buckets > 1 and diff <= ATOL
    assert r1["tp2"] == r0["tp2"]  # every rank returns the sender's stats
    # refused: both ranks raise with the server's message; the session was closed; the version did not move
    kind, message = r0["refused"]
    assert "weights' memory is released" in message, r0["refused"]
    kind1, message1 = r1["refused"]
    assert kind1 in ("IpcTransportError", "WeightSyncError") and "weights' memory is released" in message1
    assert r0["version_after_refusal"] == "a1"
    assert r0["recovered"] <= ATOL and r0["tp2_version"] == "a3"
    assert r0["tp1"][0] == tensors and r0["tp1"][1] <= ATOL and r0["tp1_versions"] == ["b1", "b1"]


# ---- trainer offload ---------------------------------------------------------------------------------------


def _storages(trainer):
    """(optimizer state storages' sizes, gradient buffer storages' sizes)."""
    state = [v.untyped_storage().nbytes() for leaf in getattr(trainer.optimizer, "chained_optimizers",
                                                                 [trainer.optimizer])
             for s in leaf.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    grads = [b.grad_data.untyped_storage().nbytes() for b in trainer.ddp.buffers + trainer.ddp.expert_parallel_buffers]
    return state, grads


def _offload_child(path):
    import train_helpers as th
    from megatron_rl import parallel
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.training import OptimConfig, PolicyTrainer, TrainConfig
    from megatron_rl.training.offload import TrainerOffload, memory_snapshot

    groups = parallel.init_megatron_parallel(parallel.ParallelLayout())  # DP=2
    batch = th.make_batch(batch_size=4, seed=7)
    local = batch.split(2)[groups.dp_rank]
    out = {}
    for distributed in (True, False):
        runs = {}
        for offload in (True, False):
            optim = OptimConfig(lr=1e-2, use_distributed_optimizer=distributed)
            trainer = PolicyTrainer(ModelConfig(hf_path=path), TrainConfig(micro_batch_size=2), groups, optim)
            off = TrainerOffload(trainer.ddp, trainer.optimizer, trainer.module) if offload else None
            losses, checks = [], []
            for step in range(3):
                if off is not None:
                    off.reload()
                losses.append(trainer.train_step(local).loss)
                if off is not None:
                    params = [p.detach().clone() for p in trainer.module.parameters()]
                    before = _storages(trainer)
                    off.offload()
                    state, grads = _storages(trainer)
                    checks.append(dict(
                        state_before=sum(before[0]), grads_before=sum(before[1]), state_after=sum(state),
                        grads_after=sum(grads), host_copies=len(off._copies),
                        params_kept=all(torch.equal(a, b) for a, b in zip(params, trainer.module.parameters())),
                        memory=sorted(memory_snapshot("m/"))))
            if off is not None:
                off.reload()
            runs[offload] = dict(losses=losses, checks=checks,
                                 params=[p.detach().clone() for p in trainer.module.parameters()],
                                 state=[{k: v.clone() for k, v in s.items()} for leaf in
                                        getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
                                        for s in leaf.optimizer.state.values()])
        out[distributed] = runs
    return out


@pytest.mark.timeout(300)
def test_trainer_offload_frees_state_and_changes_nothing(tmp_path):
    path = tiny_hf_checkpoint(str(tmp_path / "qwen3"), "qwen3")
    for rank_out in run_distributed(_offload_child, 2, path, timeout_s=280):
        for distributed, runs in rank_out.items():
            on, off = runs[True], runs[False]
            assert on["losses"] == off["losses"], distributed  # bitwise
            assert all(torch.equal(a, b) for a, b in zip(on["params"], off["params"])), distributed
            assert len(on["state"]) == len(off["state"]) > 0
            for a, b in zip(on["state"], off["state"]):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), distributed
            for c in on["checks"]:
                assert c["state_before"] > 0 and c["grads_before"] > 0, c
                assert c["state_after"] == 0 and c["grads_after"] == 0 and c["params_kept"], c
                assert c["memory"] == ["m/cpu_rss_gib"]  # CPU: no GPU numbers
            assert len({c["host_copies"] for c in on["checks"]}) == 1  # host buffers reused every round
