"""Advantage estimators (controller side, full unsharded ``[B, T]`` tensors): always per-token output.

  outcome.py  GRPO (± std; Dr.GRPO), RLOO, REINFORCE++ (± baseline)
  otb.py      Optimal Token Baseline with the logit-gradient proxy
  returns.py  return-to-go, whitening, valid-token compression

:func:`compute_advantages` dispatches on :class:`AdvantageConfig`. ``rtg`` is the per-token-reward
estimator: A_t = G_t − b_t with G the return-to-go and b_t the mean return of the group members valid
at position t (or no baseline) — a context-only baseline, so r_t is recoverable from A and b (§i).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rl.advantages.otb import logit_gradient_proxy, otb, position_baseline
from megatron_rl.advantages.outcome import grpo, group_stats, reinforce_pp, reinforce_pp_baseline, rloo
from megatron_rl.advantages.returns import masked_whiten, return_to_go, sequence_scores
from megatron_rl.config.sections import ADVANTAGE_ESTIMATORS as ESTIMATORS  # noqa: F401
from megatron_rl.config.sections import AdvantageConfig

Tensor = torch.Tensor




def rtg(token_rewards: Tensor, mask: Tensor, group_ids=None, gamma: float = 1.0,
        baseline: str = "group_mean") -> Tensor:
    """Return-to-go minus the mean return of the group members valid at each position (or nothing)."""
    mask = mask.bool()
    G = return_to_go(token_rewards, mask, gamma)
    if baseline == "none":
        return G
    if group_ids is None:
        raise ValueError("rtg with baseline='group_mean' needs group_ids")
    b = position_baseline(G, mask.to(G.dtype), mask, group_ids, eps=0.0, handle_zero_tail=False)
    return torch.where(mask, G - b, torch.zeros_like(G))


@torch.no_grad()
def compute_advantages(cfg: AdvantageConfig, token_rewards: Tensor, mask: Tensor, group_ids=None,
                       old_logprobs: Optional[Tensor] = None, sum_pi_squared: Optional[Tensor] = None,
                       is_weights: Optional[Tensor] = None) -> Tensor:
    """Per-token advantages ``[B, T]`` (0 outside ``mask``)."""
    mask = mask.bool()
    grouped = cfg.estimator in ("grpo", "rloo", "reinforce_pp_baseline", "otb") or (
        cfg.estimator == "rtg" and cfg.rtg_baseline == "group_mean")
    if grouped and group_ids is None:
        raise ValueError(f"advantage estimator {cfg.estimator!r} needs group_ids (the prompt id of every response)")
    if cfg.estimator == "grpo":
        return grpo(token_rewards, mask, group_ids, cfg.norm_by_std, cfg.eps)
    if cfg.estimator == "rloo":
        return rloo(token_rewards, mask, group_ids)
    if cfg.estimator == "reinforce_pp":
        return reinforce_pp(token_rewards, mask, cfg.gamma)
    if cfg.estimator == "reinforce_pp_baseline":
        return reinforce_pp_baseline(token_rewards, mask, group_ids)
    if cfg.estimator == "otb":
        if old_logprobs is None or sum_pi_squared is None:
            raise ValueError("advantage estimator 'otb' needs old_logprobs and sum_pi_squared "
                             "(ops.vocab_parallel_stats of the old-log-prob pass)")
        return otb(token_rewards, mask, group_ids, old_logprobs, sum_pi_squared, is_weights,
                   cfg.otb_handle_zero_tail, cfg.otb_align)
    return rtg(token_rewards, mask, group_ids, cfg.gamma, cfg.rtg_baseline)


__all__ = [
    "AdvantageConfig", "compute_advantages", "grpo", "group_stats", "logit_gradient_proxy", "masked_whiten", "otb",
    "position_baseline", "reinforce_pp", "reinforce_pp_baseline", "return_to_go", "rloo", "rtg", "sequence_scores",
]
