"""Random per-token batches and a set of objective configurations for the invariance tests.

Batches carry junk (NaN / ±inf) at masked positions on purpose: nothing may leak through masks.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from megatron_rl.objectives import (
    AggregationConfig, DenseKLConfig, DVPConfig, EntropyBonusConfig, KLPenaltyConfig, LossInputs, ObjectiveConfig,
    PolicyLossConfig, RejectionRule, RolloutCorrectionConfig, TRMConfig,
)

GRAD_FIELDS = ("logprobs", "entropy", "ref_kl")


def random_batch(B: int = 8, T: int = 8, seed: int = 0, junk: bool = True) -> Dict[str, torch.Tensor]:
    """Plain tensors (picklable). Row 0 is empty; row 1 has a hole (a tool segment); row 2 drifts a lot."""
    g = torch.Generator().manual_seed(seed)
    f64 = dict(dtype=torch.float64)

    def rn(*s):
        return torch.randn(*s, generator=g, **f64)

    lengths = torch.randint(2, T + 1, (B,), generator=g)
    lengths[0] = 0
    mask = torch.arange(T)[None, :] < lengths[:, None]
    mask[1, 2:4] = False
    old = -torch.rand(B, T, generator=g, **f64) * 2 - 0.05
    rollout = old + 0.15 * rn(B, T)
    rollout[2] = old[2] + 1.5 * rn(T)
    d = {
        "mask": mask,
        "old_logprobs": old,
        "rollout_logprobs": rollout,
        "logprobs": old + 0.1 * rn(B, T),
        "advantages": rn(B, 1).expand(B, T) + 0.3 * rn(B, T),
        "ref_logprobs": old + 0.2 * rn(B, T),
        "entropy": torch.rand(B, T, generator=g, **f64) * 2,
        "sum_pi_squared": torch.rand(B, T, generator=g, **f64) * 0.5 + 0.2,
        "rollout_kl": (0.02 * rn(B, T)).abs(),
        "ref_kl": (0.1 * rn(B, T)).abs(),
        "kept_mass": 1 - 0.05 * torch.rand(B, T, generator=g, **f64),
        "target_kept": torch.rand(B, T, generator=g) > 0.1,
    }
    d["rollout_kl"][2] += 0.2
    if junk:
        for k in ("old_logprobs", "rollout_logprobs", "logprobs", "advantages", "ref_logprobs", "rollout_kl"):
            d[k] = torch.where(mask, d[k], torch.tensor(float("nan"), **f64))
        d["entropy"] = torch.where(mask, d["entropy"], torch.tensor(float("inf"), **f64))
        d["rollout_logprobs"][~mask & (torch.arange(T) % 2 == 0)] = -float("inf")
    return d


def make_inputs(d: Dict[str, torch.Tensor], requires_grad: bool = True) -> LossInputs:
    t = {k: v.clone() for k, v in d.items()}
    if requires_grad:
        for k in GRAD_FIELDS:
            t[k].requires_grad_()
    return LossInputs(**t)


def rows(d: Dict[str, torch.Tensor], sl) -> Dict[str, torch.Tensor]:
    return {k: v[sl] for k, v in d.items()}


CONFIGS: List[Tuple[str, ObjectiveConfig]] = [
    ("ppo_tis_rs_trm_sample", ObjectiveConfig(
        policy=PolicyLossConfig(clip_eps_low=0.05, clip_eps_high=0.08),
        correction=RolloutCorrectionConfig(is_level="token", is_upper=1.5, rejection=(
            RejectionRule("k1", "token", 0.4, 2.5), RejectionRule("k2", "seq_max", upper=2.0))),
        trm=TRMConfig(enabled=True, max_kl=0.5, avg_kl=0.2, divergence="sample"),
        kl_penalty=KLPenaltyConfig(coef=0.1, estimator="k3"), entropy=EntropyBonusConfig(0.01))),
    ("gspo_seqtis_bn_trm_exact_kept", ObjectiveConfig(
        policy=PolicyLossConfig(loss="gspo", clip_eps_low=0.01, clip_eps_high=0.02),
        aggregation=AggregationConfig("seq_mean_token_mean", "kept"),
        correction=RolloutCorrectionConfig(is_level="sequence", is_upper=3.0, is_batch_normalize=True),
        trm=TRMConfig(enabled=True, max_kl=0.1))),
    ("reinforce_bypass_icepop_geo_dense", ObjectiveConfig(
        policy=PolicyLossConfig(loss="reinforce", mode="bypass"),
        aggregation=AggregationConfig("seq_mean_token_sum", "total"),
        correction=RolloutCorrectionConfig(is_level="token", is_mode="mask", is_lower=0.5, is_upper=2.0,
                                           is_batch_normalize=True,
                                           rejection=(RejectionRule("k1", "seq_mean", 0.8, 1.25),)),
        dense_kl=DenseKLConfig(beta=0.3))),
    ("ppo_bypass_seqsum_dvpmask_fixed", ObjectiveConfig(
        policy=PolicyLossConfig(mode="bypass", dual_clip_c=2.0),
        aggregation=AggregationConfig("fixed", fixed_denominator=37.0),
        correction=RolloutCorrectionConfig(rejection=(RejectionRule("k1", "seq_sum", 0.2, 5.0),
                                                      RejectionRule("k3", "token", upper=1.0))),
        dvp=DVPConfig(enabled=True, out_of_set="mask"))),
    ("ppo_seqmis_tokenmean_kept", ObjectiveConfig(
        aggregation=AggregationConfig("token_mean", "kept"),
        correction=RolloutCorrectionConfig(is_level="sequence", is_mode="mask", is_lower=0.3, is_upper=3.0),
        kl_penalty=KLPenaltyConfig(coef=0.05, estimator="low_var"))),
]
