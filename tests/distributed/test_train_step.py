"""Train-step behaviours beyond invariance: skipping non-finite steps, DVP and the reference-model KL,
bypass mode with a current-policy normaliser, and the errors a driver gets for bad input.

All on 2 gloo ranks with tiny Qwen3 models; numbers are compared with plain autograd on the unsplit
batch (see test_train_invariance.py) at 1e-5 relative.
"""

from __future__ import annotations

import copy

import pytest
import torch

from multiproc import run_distributed, tiny_hf_checkpoint

import train_helpers  # noqa: F401  (warning filters for the ranks)

RTOL = 1e-5


def _optimizer_state(trainer):
    out = []
    for leaf in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        for state in leaf.optimizer.state.values():
            out.append({k: v.detach().clone() for k, v in state.items()})
    return out


def _nan_logits_hook(module, inputs, output):
    logits, bias = output
    logits = logits.clone()
    logits[:, 0] = float("nan")  # [s, b, V/TP]: every position of the first sequence
    return logits, bias


def _nan_grad_hook(module, inputs, output):
    output[0].register_hook(lambda g: g * float("nan"))


def _skip_child(path):
    """PP=2 (the skip decision must reach the stage without a loss) + distributed optimizer."""
    import train_helpers as th
    from megatron_rl import parallel
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.lr_schedules import LRScheduleConfig
    from megatron_rl.training import OptimConfig, PolicyTrainer, TrainConfig

    groups = parallel.init_megatron_parallel(parallel.ParallelLayout(pp=2))
    optim = OptimConfig(lr=1e-2, schedule=LRScheduleConfig(warmup_steps=3))
    trainer = PolicyTrainer(ModelConfig(hf_path=path), TrainConfig(micro_batch_size=2), groups, optim)
    batch = th.make_batch(batch_size=4, seed=3)
    out = {"first": trainer.train_step(batch)}
    params = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
    opt_state, schedule = _optimizer_state(trainer), copy.deepcopy(trainer.schedule.state_dict())
    for name, hook in (("nan_logits", _nan_logits_hook), ("nan_grads", _nan_grad_hook)):
        handle = trainer.module.output_layer.register_forward_hook(hook) if trainer.built.post_process else None
        out[name] = trainer.train_step(batch)
        if handle is not None:
            handle.remove()
        out[name + "_unchanged"] = (
            all(torch.equal(p, params[n]) for n, p in trainer.module.named_parameters())
            and all(all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(_optimizer_state(trainer), opt_state))
            and trainer.schedule.state_dict() == schedule and trainer.step == 1)
    calls = []
    trainer.progress = lambda *a: calls.append(a)
    out["after"] = trainer.train_step(batch)
    trainer.forward(batch)
    out["progress"], out["last_stage"] = calls, trainer.built.post_process
    return out


def _objectives_child(path, ref_path):
    import train_helpers as th
    from megatron_rl import parallel
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.objectives import (
        AggregationConfig, DenseKLConfig, DVPConfig, KLPenaltyConfig, ObjectiveConfig, PolicyLossConfig,
        RejectionRule, RolloutCorrectionConfig,
    )
    from megatron_rl.training import OptimConfig, TrainConfig

    ref_model = ModelConfig(hf_path=ref_path)
    optim = OptimConfig(lr=1e-3, clip_grad=0.0, use_distributed_optimizer=False)
    groups = parallel.init_megatron_parallel(parallel.ParallelLayout())
    batch = th.make_batch(batch_size=8, seed=4)
    out = {}
    objectives = {
        "dvp_minp_dense_kl": (ObjectiveConfig(dvp=DVPConfig(enabled=True, min_p=0.05),
                                              dense_kl=DenseKLConfig(beta=0.1)), ref_model),
        "dvp_topk_exact_kl": (ObjectiveConfig(dvp=DVPConfig(enabled=True, rule="top_k", top_k=40),
                                              kl_penalty=KLPenaltyConfig(coef=0.05, estimator="exact")), ref_model),
    }
    # Bypass mode with a 'kept' denominator: the normaliser needs the current policy's selections.
    probe = th.plain_autograd_reference(path, batch, TrainConfig(micro_batch_size=8), groups)["stats"]
    g = torch.Generator().manual_seed(5)
    near = batch.replace(rollout_logprobs=probe["logprobs"] + 0.15 * torch.randn(probe["logprobs"].shape, generator=g))
    objectives["bypass_kept"] = (ObjectiveConfig(
        policy=PolicyLossConfig(mode="bypass"), aggregation=AggregationConfig(denominator="kept"),
        correction=RolloutCorrectionConfig(rejection=(RejectionRule("k1", "token", 0.85, 1.2),))), None)
    for name, (obj, ref) in objectives.items():
        data = near if name == "bypass_kept" else batch
        tc = TrainConfig(micro_batch_size=8, objective=obj, reference_model=ref)
        out[name] = {"ref": th.plain_autograd_reference(path, data, tc, groups)}
        for case, layout, mbs in (("tp2", dict(tp=2), 4), ("pp2", dict(pp=2), 2), ("dp2", {}, 2)):
            tc = TrainConfig(micro_batch_size=mbs, objective=obj, reference_model=ref)
            out[name][case] = th.train_run(path, layout, data, tc, optim, steps=1, forward=case == "pp2")
    return out


def _errors_child(path):
    import torch.distributed as dist

    import train_helpers as th
    from megatron_rl import parallel
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.training import OptimConfig, PolicyTrainer, TrainBatch, TrainConfig

    def message(fn):
        try:
            fn()
        except ValueError as e:
            return str(e)
        return None

    out = {}
    groups = parallel.init_megatron_parallel(parallel.ParallelLayout(tp=2))
    trainer = PolicyTrainer(ModelConfig(hf_path=path), TrainConfig(micro_batch_size=2), groups, OptimConfig())
    batch = th.make_batch(batch_size=4, seed=6)
    out["tp_mismatch"] = message(lambda: trainer.forward(th.make_batch(batch_size=4, seed=6 + dist.get_rank())))
    long = TrainBatch.from_sequences([[1] * 200], [[2] * 100], advantages=[1.0])
    out["too_long"] = message(lambda: trainer.forward(long.replace(old_logprobs=long.advantages)))
    out["no_old"] = message(lambda: trainer.train_step(batch.replace(old_logprobs=None)))
    out["mbs_too_big"] = message(lambda: trainer.train_step(batch.select([0])))
    out["bad_ids"] = message(lambda: trainer.forward(batch.replace(input_ids=batch.input_ids + 1000)))
    forward_only = PolicyTrainer(ModelConfig(hf_path=path), TrainConfig(micro_batch_size=2), groups)
    out["forward_only"] = message(lambda: forward_only.train_step(batch))
    groups = parallel.init_megatron_parallel(parallel.ParallelLayout())  # DP=2
    trainer = PolicyTrainer(ModelConfig(hf_path=path), TrainConfig(micro_batch_size=2), groups, OptimConfig())
    out["dp_counts"] = message(lambda: trainer.train_step(batch if dist.get_rank() == 0 else batch.select([0, 1])))
    return out


@pytest.mark.timeout(300)
def test_non_finite_steps_are_skipped_and_change_nothing(tmp_path):
    path = tiny_hf_checkpoint(str(tmp_path / "qwen3"), "qwen3")
    for out in run_distributed(_skip_child, 2, path, timeout_s=280):
        first, after = out["first"], out["after"]
        assert not first.skipped and first.step == 1 and first.lr == pytest.approx(1e-2 / 3)
        for name in ("nan_logits", "nan_grads"):
            r = out[name]
            assert r.skipped and out[name + "_unchanged"], name
        assert out["nan_logits"].metrics["train/nonfinite_policy_tokens"] > 0
        assert out["nan_grads"].metrics["train/nonfinite_policy_tokens"] == 0  # the loss was fine
        assert out["nan_grads"].skipped_steps == 2
        # Training resumes where it stopped: step 2 with the schedule's second LR.
        assert not after.skipped and after.step == 2 and after.lr == pytest.approx(2e-2 / 3)
        assert after.metrics["train/skipped_steps"] == 2
        # progress ticks: one per micro-batch (4 sequences / 2), on the stage that computes the loss
        expected = [(f"{p} micro-batches", k, 2, "mb") for p in ("train", "forward") for k in (1, 2)]
        assert out["progress"] == (expected if out["last_stage"] else [])


@pytest.mark.timeout(300)
def test_dvp_reference_kl_and_bypass_match_unsplit_autograd(tmp_path):
    path = tiny_hf_checkpoint(str(tmp_path / "policy"), "qwen3", seed=0)
    ref_path = tiny_hf_checkpoint(str(tmp_path / "reference"), "qwen3", seed=1)
    for out in run_distributed(_objectives_child, 2, path, ref_path, timeout_s=280):
        for name, runs in out.items():
            ref = runs["ref"]
            for case in ("tp2", "pp2", "dp2"):
                run = runs[case]
                assert not run["skipped"][0], (name, case)
                assert abs(run["losses"][0] - ref["loss"]) <= RTOL * abs(ref["loss"]), (name, case)
                assert abs(run["grad_norms"][0] - ref["grad_norm"]) <= RTOL * ref["grad_norm"], (name, case)
                for n, g in ref["grads"].items():
                    assert (run["grads"][n] - g).abs().max() <= RTOL * g.abs().max(), (name, case, n)
            fwd, stats = runs["pp2"]["forward"], ref["stats"]
            mask = fwd["response_mask"]
            for key in ("logprobs", "full_logprobs", "kept_mass", "ref_kl"):
                if key in stats:
                    assert (fwd[key] - stats[key])[mask].abs().max() <= 1e-5, (name, key)
        assert out["dvp_minp_dense_kl"]["pp2"]["metrics"]["dvp/pruned_mass"] > 1e-3  # pruning happened
        kept = out["bypass_kept"]["dp2"]["metrics"]
        assert 0 < kept["tokens/kept"] < kept["tokens/valid"]  # the rejection rule removed some tokens


@pytest.mark.timeout(300)
def test_bad_input_raises_clear_value_errors(tmp_path):
    path = tiny_hf_checkpoint(str(tmp_path / "qwen3"), "qwen3")
    for out in run_distributed(_errors_child, 2, path, timeout_s=280):
        assert "different batches" in out["tp_mismatch"]
        assert "max_position_embeddings=256" in out["too_long"]
        assert "old_logprobs" in out["no_old"]
        assert "micro_batch_size=2 is larger than" in out["mbs_too_big"]
        assert "token ids must lie in [0, 250)" in out["bad_ids"]
        assert "without an OptimConfig" in out["forward_only"]
        assert "same number" in out["dp_counts"]
