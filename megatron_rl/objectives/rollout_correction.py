"""Rollout correction: importance weights and rejection masks for the μ → π_anchor drift (§e, §f).

Inputs are per-token log-ratios λ_t = log π_a(y_t) − log μ(y_t) (π_a = π_old in decoupled mode,
sg(π_θ) in bypass mode), clamped to ±20 per token — and for sequence quantities their *sum* is clamped
(only before exponentiating), never summed from per-token clamped values (§e.2). Outputs are **detached**: a weight ``w`` ``[B, T]`` that
multiplies the policy-gradient term, and keep masks (token ``[B, T]``, sequence ``[B]``).

**Bounds are defined directly on ρ = π_a/μ** (token ρ_t, sequence ρ(y) = Π_t ρ_t, or geometric
ρ_geo = ρ(y)^{1/T}). verl compares its k1 statistic −λ with ``[log lo, log hi]``, which for
asymmetric bounds keeps ρ ∈ [1/hi, 1/lo] (math_spec §e.3, check 12); here ``lower=0.6, upper=1.6``
keeps exactly ρ ∈ [0.6, 1.6]. Comparisons are made in log space, so they stay exact when the clamp
saturates (§e.8).

Estimator map (math_spec §f.2):

=============  =================================================================
Token-TIS      ``is_level="token", is_mode="truncate", is_upper=C``
Seq-TIS        ``is_level="sequence", is_mode="truncate", is_upper=C``
IcePop         ``is_level="token", is_mode="mask", is_lower=lo, is_upper=hi``
Seq-MIS        ``is_level="sequence", is_mode="mask", is_upper=C`` (``is_lower`` for two-sided)
Geo-mask       ``RejectionRule("k1", "seq_mean", lower, upper)``
TRM-style RS   ``RejectionRule("k2", "seq_max", upper=δ)`` (+ ``("k3", "seq_mean", upper=δ_avg)``)
=============  =================================================================

``is_mode="mask"`` *rejects* out-of-range tokens/sequences (they leave the loss and a ``kept``
denominator) and weighs the rest by the untruncated ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from megatron_rl.config.objective import CORRECTION_LEVELS as LEVELS  # noqa: F401
from megatron_rl.config.objective import PRESETS, STATISTICS, RejectionRule, RolloutCorrectionConfig  # noqa: F401
from megatron_rl.objectives.divergence import SeqDivergenceStats, clamp_log_ratio, k2, k3

Tensor = torch.Tensor








@dataclass
class Correction:
    """Detached outputs. ``weights`` is 1 where unused; ``token_keep``/``seq_keep`` are True for tokens
    and sequences that pass (and for empty sequences, which are no-ops)."""

    weights: Tensor
    token_keep: Tensor
    seq_keep: Tensor
    rejected_by: Dict[str, Tensor] = field(default_factory=dict)  # rule name -> rejected (token or seq) mask
    is_truncated: Optional[Tensor] = None  # token-level bool: the weight hit the cap (or was rejected by it)
    seq_weights: Optional[Tensor] = None  # [B] the per-sequence weight (sequence level only)


def _ratio_in_bounds(log_value: Tensor, lower: Optional[float], upper: Optional[float]) -> Tensor:
    ok = torch.ones_like(log_value, dtype=torch.bool)
    if lower is not None:
        ok &= log_value >= (math.log(lower) if lower > 0 else -math.inf)
    if upper is not None:
        ok &= log_value <= math.log(upper)
    return ok


def _rule_keep(rule: RejectionRule, log_ratio: Tensor, stats: SeqDivergenceStats) -> Tensor:
    """Keep mask of one rule: ``[B, T]`` for token rules, ``[B]`` for sequence rules."""
    if rule.level == "token":
        if rule.statistic == "k1":
            return _ratio_in_bounds(log_ratio, rule.lower, rule.upper)
        return (k2(log_ratio) if rule.statistic == "k2" else k3(log_ratio)) <= rule.upper
    if rule.statistic == "k1":
        value = stats.sum_log_ratio if rule.level == "seq_sum" else stats.mean_log_ratio
        keep = _ratio_in_bounds(value, rule.lower, rule.upper)
    else:
        what = rule.statistic
        if rule.level == "seq_sum":
            value = getattr(stats, f"sum_{what}")
        elif rule.level == "seq_mean":
            value = stats.mean(what)
        else:
            value = getattr(stats, f"max_{what}")
        keep = value <= rule.upper
    return keep | ~stats.nonempty  # an empty sequence is a no-op, never "rejected"


@torch.no_grad()
def compute_correction(log_ratio: Tensor, valid: Tensor, stats: SeqDivergenceStats,
                       cfg: RolloutCorrectionConfig) -> Correction:
    """IS weights and rejection masks from λ ``[B, T]`` (clamped here, per token) and its CP-reduced
    sequence stats (sums of the unclamped λ: a sequence weight is exp(clamp(Σλ)), not exp(Σ clamp(λ)), §e.2)."""
    lr = clamp_log_ratio(log_ratio.detach())
    B = lr.shape[0]
    token_keep = torch.ones_like(valid)
    seq_keep = torch.ones(B, dtype=torch.bool, device=valid.device)
    rejected: Dict[str, Tensor] = {}
    for rule in cfg.rejection:
        keep = _rule_keep(rule, lr, stats)
        rejected[rule.name] = ~keep & (valid if rule.level == "token" else stats.nonempty)
        if rule.level == "token":
            token_keep &= keep
        else:
            seq_keep &= keep

    weights = torch.ones_like(lr)
    truncated = None
    if cfg.is_level is not None:
        if cfg.is_level == "token":
            log_w = lr
        else:
            log_w = stats.sum_log_ratio.to(lr.dtype)[:, None].expand_as(lr)
        if cfg.is_mode == "truncate":
            truncated = log_w > math.log(cfg.is_upper)
            weights = torch.exp(clamp_log_ratio(log_w)).clamp(max=cfg.is_upper)
        else:
            inside = _ratio_in_bounds(log_w, cfg.is_lower, cfg.is_upper)
            truncated = ~inside
            weights = torch.where(inside, torch.exp(clamp_log_ratio(log_w)), torch.zeros_like(lr))
            if cfg.is_level == "token":
                token_keep &= inside
                rejected["is_mask"] = ~inside & valid
            else:
                seq_in = _ratio_in_bounds(stats.sum_log_ratio, cfg.is_lower, cfg.is_upper) | ~stats.nonempty
                seq_keep &= seq_in
                rejected["is_mask"] = ~seq_in & stats.nonempty
        weights = torch.where(valid, weights, torch.ones_like(weights)).contiguous()
        truncated = truncated & valid
        if cfg.is_level == "sequence":
            log_s = stats.sum_log_ratio
            if cfg.is_mode == "truncate":
                seq_weights = torch.exp(clamp_log_ratio(log_s)).clamp(max=cfg.is_upper)
            else:
                seq_in = _ratio_in_bounds(log_s, cfg.is_lower, cfg.is_upper)
                seq_weights = torch.where(seq_in, torch.exp(clamp_log_ratio(log_s)), torch.zeros_like(log_s))
            return Correction(weights, token_keep, seq_keep, rejected, truncated, seq_weights)
    return Correction(weights, token_keep, seq_keep, rejected, truncated)
