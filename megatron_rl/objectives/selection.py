"""Which tokens a loss uses and with which importance weights — everything detached, decided before
any differentiable math (sanitisation, DVP out-of-set policy, rollout correction, TRM, MoE routing
mask). Every rejection is ANDed into ``keep`` (and the sequence ones into ``seq_keep``).

The same function runs inside the loss and in :func:`megatron_rl.objectives.loss.step_normalizer`
(to count the step's ``kept`` denominator over all micro-batches), so both see identical masks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_rl.config.objective import ObjectiveConfig
from megatron_rl.objectives.divergence import SeqDivergenceStats, clamp_log_ratio, seq_divergence_stats
from megatron_rl.objectives.dvp import out_of_set_keep
from megatron_rl.objectives.records import LossInputs
from megatron_rl.objectives.reduce import ReduceGroups
from megatron_rl.objectives.rollout_correction import Correction, compute_correction
from megatron_rl.objectives.routing_mask import RoutingMaskResult, routing_mask
from megatron_rl.objectives.trm import TRMResult, trm_mask

Tensor = torch.Tensor


@dataclass
class Selection:
    inputs: LossInputs  # sanitised: every float field is 0 (and gradient-free) outside ``valid``
    valid: Tensor  # [B, T] loss mask minus tokens with non-finite inputs — the ``total`` population
    keep: Tensor  # [B, T] valid tokens that survive every rejection — the tokens the loss uses
    weights: Tensor  # [B, T] rollout-correction IS weights (1 where none), before batch normalisation
    seq_weights: Optional[Tensor]  # [B] sequence-level IS weights (sequence level only)
    anchor: Optional[Tensor]  # log-probs the PPO/GSPO ratio is taken against (π_old or μ)
    log_ratio: Optional[Tensor]  # [B, T] clamped λ = log π_a − log μ of the correction (None without μ)
    stats: Optional[SeqDivergenceStats]
    correction: Optional[Correction]
    trm: Optional[TRMResult]
    seq_keep: Tensor  # [B] sequence-level acceptance (sequence rules, Seq-MIS, TRM)
    dvp_keep: Optional[Tensor]
    n_nonfinite: Tensor
    routing: Optional[RoutingMaskResult] = None


def select_tokens(inputs: LossInputs, cfg: ObjectiveConfig, groups: ReduceGroups = ReduceGroups()) -> Selection:
    x, valid, n_bad = inputs.sanitized()  # keeps the graph: the loss differentiates the sanitised copy
    with torch.no_grad():
        return _select(x, valid, n_bad, cfg, groups)


def _select(x: LossInputs, valid: Tensor, n_bad: Tensor, cfg: ObjectiveConfig, groups: ReduceGroups) -> Selection:
    B = valid.shape[0]
    if cfg.policy.mode == "decoupled":
        if x.old_logprobs is None:
            raise ValueError("policy.mode='decoupled' needs LossInputs.old_logprobs (the proximal policy from the "
                             "trainer's forward pass at the start of the step; on-policy: logprobs.detach()), or use "
                             "policy.mode='bypass'")
        anchor, corr_logp = x.old_logprobs.detach(), x.old_logprobs.detach()
    else:
        if x.rollout_logprobs is None:
            raise ValueError("policy.mode='bypass' needs LossInputs.rollout_logprobs (π_old := μ)")
        # Bypass: correction statistics of the *current* policy vs μ, computed under no_grad (§e.1).
        anchor, corr_logp = x.rollout_logprobs.detach(), x.logprobs.detach()

    log_ratio = raw_log_ratio = None
    if x.rollout_logprobs is not None:
        raw_log_ratio = corr_logp - x.rollout_logprobs.detach()
        log_ratio = clamp_log_ratio(raw_log_ratio)
    if cfg.correction.active and log_ratio is None:
        raise ValueError("rollout correction is configured but LossInputs.rollout_logprobs is missing")
    if cfg.trm.enabled and log_ratio is None and x.rollout_kl is None:
        raise ValueError("TRM needs LossInputs.rollout_logprobs (sample path) or LossInputs.rollout_kl (exact path)")

    stats = None
    if log_ratio is not None or x.rollout_kl is not None:
        lr = raw_log_ratio if raw_log_ratio is not None else torch.zeros_like(x.logprobs.detach())
        stats = seq_divergence_stats(lr, valid, groups.cp, exact=x.rollout_kl)  # sums the unclamped λ (§e.2)

    keep = valid.clone()
    dvp_keep = out_of_set_keep(x.target_kept, valid, cfg.dvp)
    if dvp_keep is not None:
        keep &= dvp_keep
    seq_keep = torch.ones(B, dtype=torch.bool, device=valid.device)
    weights = torch.ones_like(x.logprobs.detach())
    seq_weights = None
    correction = None
    if cfg.correction.active:
        correction = compute_correction(log_ratio, valid, stats, cfg.correction)
        keep &= correction.token_keep & correction.seq_keep[:, None]
        seq_keep &= correction.seq_keep
        weights = correction.weights.to(weights.dtype)
        if cfg.correction.is_level == "sequence":
            seq_weights = correction.seq_weights
    trm = None
    if cfg.trm.enabled:
        trm = trm_mask(stats, cfg.trm)
        keep &= trm.keep[:, None]
        seq_keep &= trm.keep
    routing = None
    if cfg.routing_mask.enabled:
        routing = routing_mask(x.routing_disagreement, valid, cfg.routing_mask, groups.cp)
        keep &= routing.token_keep & routing.seq_keep[:, None]
        seq_keep &= routing.seq_keep
    return Selection(x, valid, keep, weights, seq_weights, anchor, log_ratio, stats, correction, trm, seq_keep,
                     dvp_keep, n_bad, routing)
