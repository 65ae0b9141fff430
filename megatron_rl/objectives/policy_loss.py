"""Per-token policy-gradient surrogates: PPO clip (asymmetric ε, dual clip), GSPO, REINFORCE (§e.1).

Each function returns the per-token loss ``ℓ_t`` (before rollout-correction weights, masks and
aggregation) and the clip indicators the metrics report. The *anchor* of the ratio is π_old in
decoupled mode and μ (the rollout policy) in bypass mode; :mod:`megatron_rl.objectives.loss` picks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_rl.config.objective import LOSSES, PolicyLossConfig  # noqa: F401
from megatron_rl.config.objective import POLICY_MODES as MODES  # noqa: F401
from megatron_rl.objectives.divergence import clamp_log_ratio
from megatron_rl.objectives.reduce import ProcessGroup, seq_sum_count

Tensor = torch.Tensor




@dataclass
class PolicyTerm:
    """Per-token surrogate loss ``[B, T]`` and clip indicators (bool ``[B, T]``)."""

    loss: Tensor
    clipped_high: Tensor
    clipped_low: Tensor
    dual_clipped: Tensor
    log_ratio: Tensor  # detached log(π_θ/anchor) per token (the sequence log-ratio for GSPO)


def _clipped_surrogate(ratio: Tensor, adv: Tensor, cfg: PolicyLossConfig, log_ratio: Tensor) -> PolicyTerm:
    """−min(rA, clip(r)A), then for A<0 the dual-clip cap c|A| (verl ``compute_policy_loss_vanilla``)."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
    loss = torch.maximum(unclipped, clipped)
    r = ratio.detach()
    clipped_high = (adv > 0) & (r > 1 + cfg.clip_eps_high)
    clipped_low = (adv < 0) & (r < 1 - cfg.clip_eps_low)
    dual = torch.zeros_like(clipped_high)
    if cfg.dual_clip_c is not None:
        cap = -adv * cfg.dual_clip_c
        dual = (adv < 0) & (loss.detach() > cap)
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
    return PolicyTerm(loss, clipped_high, clipped_low, dual, log_ratio.detach())


def ppo_clip_token_loss(logprobs: Tensor, anchor_logprobs: Tensor, advantages: Tensor,
                        cfg: PolicyLossConfig) -> PolicyTerm:
    """PPO clip with r_t = π_θ(y_t)/π_anchor(y_t); log r clamped to ±20 (no gradient beyond, as verl)."""
    log_ratio = clamp_log_ratio(logprobs - anchor_logprobs.detach())
    return _clipped_surrogate(torch.exp(log_ratio), advantages, cfg, log_ratio)


def gspo_token_loss(logprobs: Tensor, anchor_logprobs: Tensor, advantages: Tensor, keep: Tensor,
                    cfg: PolicyLossConfig, cp_group: ProcessGroup = None) -> PolicyTerm:
    """GSPO-token: s_{i,t} = sg(s_i) · π_θ(y_t)/sg(π_θ(y_t)), s_i = exp(mean_t log(π_θ/π_anchor)).

    The value of every token's ratio is the sequence's geometric-mean ratio s_i, so the clip decision
    is per sequence, while the gradient is token-local: with ``seq_mean_token_mean`` aggregation it
    equals −A ∇s_i exactly (GSPO paper). The sequence mean is over surviving tokens, reduced over CP as
    (sum, count) — detached, so no collective needs a backward.
    """
    tok_log_ratio = (logprobs - anchor_logprobs).detach()
    s, n = seq_sum_count(tok_log_ratio, keep, cp_group)
    seq_log_ratio = (s / n.clamp(min=1)).to(logprobs.dtype)
    log_ratio = clamp_log_ratio(logprobs - logprobs.detach() + seq_log_ratio[:, None])
    return _clipped_surrogate(torch.exp(log_ratio), advantages, cfg, log_ratio)


def reinforce_token_loss(logprobs: Tensor, advantages: Tensor) -> PolicyTerm:
    """−A·log π_θ(y_t). IS weights (detached) are applied by the caller."""
    no = torch.zeros_like(logprobs, dtype=torch.bool)
    return PolicyTerm(-advantages * logprobs, no, no, no, torch.zeros_like(logprobs).detach())


def policy_token_loss(logprobs: Tensor, anchor_logprobs: Optional[Tensor], advantages: Tensor, keep: Tensor,
                      cfg: PolicyLossConfig, cp_group: ProcessGroup = None) -> PolicyTerm:
    advantages = advantages.detach()  # a learning signal, never a path for gradients
    if cfg.loss == "reinforce":
        return reinforce_token_loss(logprobs, advantages)
    if anchor_logprobs is None:
        raise ValueError(f"PolicyLossConfig.loss={cfg.loss!r} needs an anchor policy: old_logprobs (mode "
                         "'decoupled') or rollout_logprobs (mode 'bypass')")
    if cfg.loss == "gspo":
        return gspo_token_loss(logprobs, anchor_logprobs, advantages, keep, cfg, cp_group)
    return ppo_clip_token_loss(logprobs, anchor_logprobs, advantages, cfg)
