"""Weight sync and checkpoints under the CPU placement guard (tests/device_guard.py), one rank (gloo):
the trainer's and the embedded engine's tensors are device tensors, as on one GPU. A sync after a train
step passes the probe check; a checkpoint saved after one step (then exported to HF, and the optimizer
offloaded and reloaded) and loaded into a fresh trainer gives the next steps' losses and grad norms of the
uninterrupted run (bitwise: same process, same kernels)."""

from __future__ import annotations

import os

import pytest

from multiproc import run_distributed, tiny_hf_checkpoint

import train_helpers  # noqa: F401  (warning filters for the ranks)


def _child(path, root):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import train_helpers as th
    from device_guard import DeviceGuard
    from megatron_rl import parallel
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.rollout.embedded.engine import EmbeddedEngine
    from megatron_rl.weights.sync import WeightSync, WeightSyncConfig
    from megatron_rl.training import OptimConfig, PolicyTrainer, TrainConfig
    from megatron_rl.models.weights import save_hf_checkpoint
    from megatron_rl.training import checkpoint as ck
    from megatron_rl.training.offload import TrainerOffload

    groups = parallel.init_megatron_parallel(parallel.ParallelLayout())
    batches = [th.make_batch(batch_size=4, seed=s) for s in (20, 21, 22)]

    def trainer():  # built outside the guard (see test_device_guard_train.py), placed inside it
        return PolicyTrainer(ModelConfig(hf_path=path), TrainConfig(micro_batch_size=2), groups, OptimConfig(lr=1e-2))

    tr, fresh, model = trainer(), trainer(), EmbeddedEngine.from_pretrained(path).model
    cfg = ck.CheckpointConfig(os.path.join(root, "ck"), keep_last=1)
    out = {}
    with DeviceGuard() as guard:
        guard.place_trainer(tr)
        guard.place_trainer(fresh)
        guard.place(model)
        engine = EmbeddedEngine(model)  # takes its device from its (device) parameters
        for b in batches:
            guard.host(b)
        tr.train_step(batches[0])
        sync = WeightSync(tr.built, engine, WeightSyncConfig(bucket_mb=0.03, progress=False))
        out["sync"] = sync.sync(version=1).check.max_abs_diff
        ck.save_checkpoint(tr, cfg)
        save_hf_checkpoint(tr.built, os.path.join(root, "hf"), src_dir=path)  # export
        offload = TrainerOffload(tr.ddp, tr.optimizer, tr.module)  # a colocated trainer's round trip
        offload.offload()
        offload.reload()
        out["uninterrupted"] = [(r.loss, r.grad_norm) for r in (tr.train_step(b) for b in batches[1:])]
        ck.load_checkpoint(fresh, cfg.root)
        out["resumed"] = [(r.loss, r.grad_norm) for r in (fresh.train_step(b) for b in batches[1:])]
    return out


@pytest.mark.timeout(300)
def test_sync_and_checkpoint_under_the_placement_guard(tmp_path):
    path = tiny_hf_checkpoint(str(tmp_path / "m"), "qwen3")
    (out,) = run_distributed(_child, 1, path, str(tmp_path), timeout_s=280)
    assert out["sync"] <= 1e-4, out
    assert out["resumed"] == out["uninterrupted"], out
