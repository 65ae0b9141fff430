"""Checkpoints: bitwise resume (RNG included), atomic saves (a crash mid-save leaves ``latest`` alone),
keep-last-K, resharding TP2 -> PP2 / TP1 and PP2 -> TP1, and the ValueError for an unsupported reshard.

One 2-rank job on a tiny Qwen3 with the distributed optimizer (``fully_reshardable``), the
length-surge LR schedule (its state machine must survive the round trip) and an opaque driver dict.
The reference run continues without interruption; resumed runs must reproduce its next two losses:
bitwise in the same layout, within 1e-5 relative in another (measured: <= 4e-7).
"""

from __future__ import annotations

import os

import pytest
import torch

from multiproc import run_distributed, tiny_hf_checkpoint

import train_helpers  # noqa: F401  (warning filters for the ranks)

RTOL = 1e-5


def _child(path, root):
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    import train_helpers as th
    from megatron_rl import parallel
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.lr_schedules import LRScheduleConfig
    from megatron_rl.training import OptimConfig, PolicyTrainer, TrainConfig
    from megatron_rl.training import checkpoint as ck

    surge = LRScheduleConfig(kind="length_surge", warmup_steps=1, baseline_steps=1, surge_factor=1.1,
                             min_period=1)
    batches = [th.make_batch(batch_size=4, seed=s, max_response=4 + 4 * (s % 2)) for s in range(10, 14)]

    def trainer(layout, fmt_optim=OptimConfig(lr=1e-2, schedule=surge)):
        groups = parallel.init_megatron_parallel(parallel.ParallelLayout(**layout))
        tr = PolicyTrainer(ModelConfig(hf_path=path), TrainConfig(micro_batch_size=1), groups, fmt_optim)
        dp = dist.get_world_size(groups.dp)
        return tr, (lambda b: tr.train_step(b.split(dp)[groups.dp_rank]))

    out = {}
    cfg = ck.CheckpointConfig(os.path.join(root, "main"), keep_last=2)
    tr, step = trainer(dict(tp=2))
    step(batches[0])
    ck.save_checkpoint(tr, cfg, extra={"sampler": {"epoch": 0, "index": 4}})
    step(batches[1])
    ck.save_checkpoint(tr, cfg, extra={"sampler": {"epoch": 0, "index": 8}})
    out["schedule_at_2"] = tr.schedule.state_dict()
    out["rng_at_2"] = torch.rand(3)  # a resumed run in this layout must draw the same numbers
    out["reference"] = [(r.loss, r.grad_norm, r.lr) for r in (step(batches[2]), step(batches[3]))]

    real_save = dist_checkpointing.save

    def crash_after_writing(*args, **kwargs):
        real_save(*args, **kwargs)
        raise RuntimeError("simulated crash mid-save")

    dist_checkpointing.save = crash_after_writing
    try:
        ck.save_checkpoint(tr, cfg)
    except RuntimeError as e:
        out["crash"] = str(e)
    finally:
        dist_checkpointing.save = real_save
    out["after_crash"] = (ck.latest_checkpoint(cfg.root), sorted(os.listdir(cfg.root)))
    ck.save_checkpoint(tr, cfg)  # cleans the crashed save's leftovers, prunes to the last 2
    out["after_save"] = sorted(os.listdir(cfg.root))

    def resume(layout, **kw):
        tr, step = trainer(layout, **kw)
        loaded = ck.load_checkpoint(tr, cfg.root, step=2)
        info = {"step": tr.step, "extra": loaded.extra, "rng": loaded.rng_loaded, "schedule": tr.schedule.state_dict(),
                "draw": torch.rand(3)}
        return info, [(r.loss, r.grad_norm, r.lr) for r in (step(batches[2]), step(batches[3]))]

    for name, layout in (("tp2", dict(tp=2)), ("pp2", dict(pp=2)), ("tp1", {})):
        out[name] = resume(layout)

    # dp_reshardable: bitwise in the same layout; another TP/PP layout is refused up front.
    cfg_dp = ck.CheckpointConfig(os.path.join(root, "dp"), optimizer_format="dp_reshardable")
    tr, step = trainer(dict(tp=2))
    step(batches[0])
    ck.save_checkpoint(tr, cfg_dp)
    out["dp_reference"] = [step(batches[1]).loss, step(batches[2]).loss]
    tr, step = trainer(dict(tp=2))
    ck.load_checkpoint(tr, cfg_dp.root)
    out["dp_resumed"] = [step(batches[1]).loss, step(batches[2]).loss]
    tr, step = trainer(dict(pp=2))
    try:
        ck.load_checkpoint(tr, cfg_dp.root)
    except ValueError as e:
        out["dp_refused"] = str(e)

    # PP=2 -> TP=1 (DP=2), optimizer state included.
    cfg_pp = ck.CheckpointConfig(os.path.join(root, "pp"))
    step(batches[0])
    ck.save_checkpoint(tr, cfg_pp)
    out["pp_reference"] = [step(batches[1]).loss, step(batches[2]).loss]
    tr, step = trainer({})
    ck.load_checkpoint(tr, cfg_pp.root)
    out["pp_to_tp1"] = [step(batches[1]).loss, step(batches[2]).loss]
    return out


@pytest.mark.timeout(300)
def test_resume_atomic_save_retention_and_resharding(tmp_path):
    path = tiny_hf_checkpoint(str(tmp_path / "qwen3"), "qwen3")
    for out in run_distributed(_child, 2, path, str(tmp_path / "ckpt"), timeout_s=280):
        ref = out["reference"]
        assert ref[0][2] != ref[1][2], "the length-surge schedule should have changed the LR"
        assert out["crash"] == "simulated crash mid-save"
        latest, listing = out["after_crash"]
        assert latest.endswith("iter_0000002")
        assert "iter_0000004" not in listing and ".tmp_iter_0000004" in listing  # half-written, not marked
        assert out["after_save"] == ["iter_0000002", "iter_0000004", "latest"]  # iter_1 pruned, tmp gone

        info, resumed = out["tp2"]
        assert info["step"] == 2 and info["rng"] and info["schedule"] == out["schedule_at_2"]
        assert info["extra"] == {"sampler": {"epoch": 0, "index": 8}}
        assert resumed == ref  # bitwise: losses, grad norms and LRs of the next two steps
        assert torch.equal(info["draw"], out["rng_at_2"])
        for name in ("pp2", "tp1"):
            info, resharded = out[name]
            assert info["step"] == 2 and not info["rng"] and info["schedule"] == out["schedule_at_2"]
            for (loss, norm, lr), (rl, rn, rlr) in zip(resharded, ref):
                assert abs(loss - rl) <= RTOL * abs(rl) and abs(norm - rn) <= RTOL * rn and lr == rlr, name

        assert out["dp_resumed"] == out["dp_reference"]
        assert "reshards over data parallelism only" in out["dp_refused"]
        for got, want in zip(out["pp_to_tp1"], out["pp_reference"]):
            assert abs(got - want) <= RTOL * abs(want)


def _moe_child(path, root, fmt):
    import torch.distributed as dist

    import train_helpers as th
    from megatron_rl import parallel
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.training import OptimConfig, PolicyTrainer, TrainConfig
    from megatron_rl.training import checkpoint as ck

    batches = [th.make_batch(batch_size=4, seed=s) for s in range(20, 24)]

    def trainer():
        groups = parallel.init_megatron_parallel(parallel.ParallelLayout(ep=2))
        tr = PolicyTrainer(ModelConfig(hf_path=path), TrainConfig(micro_batch_size=1), groups, OptimConfig(lr=1e-2))
        dp = dist.get_world_size(groups.dp)
        return tr, (lambda b: tr.train_step(b.split(dp)[groups.dp_rank]))

    cfg = ck.CheckpointConfig(os.path.join(root, fmt), optimizer_format=fmt)
    tr, step = trainer()
    step(batches[0])
    step(batches[1])
    ck.save_checkpoint(tr, cfg)
    reference = [(r.loss, r.grad_norm) for r in (step(batches[2]), step(batches[3]))]
    tr, step = trainer()
    ck.load_checkpoint(tr, cfg.root)
    return reference, [(r.loss, r.grad_norm) for r in (step(batches[2]), step(batches[3]))]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["fully_reshardable", "dp_reshardable"])
def test_moe_expert_parallel_resume_is_bitwise(tmp_path, fmt):
    """EP=2 (attention data-parallel over the same 2 ranks): each rank's expert optimizer state must
    come back, or the next steps' losses and gradient norms drift (they do when the optimizer state is
    not loaded). Megatron warns at save that rank 1's common optimizer state differs from rank 0's
    ('param_state' keys); this test is why that warning is known to be harmless here."""
    path = tiny_hf_checkpoint(str(tmp_path / "moe"), "qwen3_moe")
    for reference, resumed in run_distributed(_moe_child, 2, path, str(tmp_path / "ckpt"), fmt, timeout_s=280):
        assert resumed == reference
