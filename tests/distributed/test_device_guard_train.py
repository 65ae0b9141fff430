"""The trainer under the CPU placement guard (tests/device_guard.py): a whole train step runs as a CUDA
run would place it, for dense and MoE (routing replay), packed and padded, fused and unfused head,
decoupled mode with ``forward()`` first. One rank (gloo); the batch is built on the host, as the driver
builds it. A host tensor meeting a device one raises ``PlacementError`` (the bug class of issue 22: the
micro-batch's CPU ``input_ids`` reaching the embedding's ``index_select``)."""

from __future__ import annotations

import math

import pytest

from multiproc import run_distributed, tiny_hf_checkpoint

import train_helpers  # noqa: F401  (warning filters for the ranks)


def _child(dense, moe):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import train_helpers as th
    from device_guard import DeviceGuard
    from megatron_rl import parallel
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.objectives import ObjectiveConfig, RolloutCorrectionConfig
    from megatron_rl.training import OptimConfig, PolicyTrainer, TrainConfig

    groups = parallel.init_megatron_parallel(parallel.ParallelLayout())
    decoupled = ObjectiveConfig(correction=RolloutCorrectionConfig(is_level="token"))
    cases = {  # checkpoint, train config, batch
        "dense_packed_fused": (dense, dict(packing=True, fused_head=True, max_tokens_per_micro_batch=32), {}),
        "dense_padded_unfused": (dense, dict(packing=False, fused_head=False, micro_batch_size=2), {}),
        "moe_packed_replay": (moe, dict(packing=True, routing_replay=True, micro_batch_size=2), dict(moe_layers=2)),
        "moe_padded": (moe, dict(packing=False, micro_batch_size=4), dict(moe_layers=2)),
    }
    out = {}
    for name, (path, tc, bkw) in cases.items():
        # built outside the guard (Megatron's optimizer checks parameter types by name); its parameters
        # are then device tensors, as a trainer built on CUDA has them
        trainer = PolicyTrainer(ModelConfig(hf_path=path), TrainConfig(objective=decoupled, **tc), groups,
                                OptimConfig(lr=1e-3, clip_grad=1.0))
        with DeviceGuard() as guard:
            guard.place_trainer(trainer)
            batch = th.make_batch(batch_size=8, seed=2, **bkw).replace(old_logprobs=None)
            guard.host(batch)
            fwd = trainer.forward(batch)
            batch = batch.replace(old_logprobs=fwd.logprobs)
            losses = [trainer.train_step(batch).loss for _ in range(2)]
        out[name] = dict(losses=losses, fwd_host=all(not guard.is_device(v) for v in vars(fwd).values()))
    return out


@pytest.mark.timeout(400)
def test_train_step_places_every_tensor_on_the_device(tmp_path):
    dense = tiny_hf_checkpoint(str(tmp_path / "dense"), "qwen3")
    moe = tiny_hf_checkpoint(str(tmp_path / "moe"), "qwen3_moe")
    (out,) = run_distributed(_child, 1, dense, moe, timeout_s=380)
    for name, r in out.items():
        assert all(math.isfinite(v) for v in r["losses"]), (name, r)
        assert r["losses"][0] != r["losses"][1], name  # the step changed the weights
        assert r["fwd_host"], name  # results come back on the host
