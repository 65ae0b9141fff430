"""Trust Region Masking (TRM, arXiv 2512.23075; math_spec §a.3).

A sequence is kept iff ``max_t D(c_t) <= δ`` (TRM-Max, length-invariant) AND, optionally,
``mean_t D(c_t) <= δ_avg`` (TRM-Avg). The divergence D(c_t) estimates KL(π_roll(·|c_t) ‖ π_a(·|c_t)):

* ``exact``: the full-vocabulary KL per token (``LossInputs.rollout_kl``, from
  :func:`exact_rollout_kl`) — the only path for which the paper's guarantee holds;
* ``sample``: k2 = ½λ² for the max criterion (symmetric: catches ρ → 0 and ρ → ∞; ``k2 <= δ`` ⇔
  ``|λ| <= sqrt(2δ)``) and k3 (unbiased for the same KL) for the mean criterion.

The mean criterion uses the same source as the max one: the exact KL when it is at hand (k3 only
estimates exactly that quantity), k3 otherwise. Thresholds must be calibrated per estimator (§a.4).
Rejected sequences contribute zero and still count in a ``total`` denominator (the paper's 1/N).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.config.objective import DIVERGENCES, TRMConfig  # noqa: F401
from megatron_rl.objectives.divergence import SeqDivergenceStats
from megatron_rl.ops import vocab_parallel_kl

Tensor = torch.Tensor




def uses_exact(cfg: TRMConfig, has_exact: bool) -> bool:
    if cfg.divergence == "exact" and not has_exact:
        raise ValueError("TRMConfig.divergence='exact' needs LossInputs.rollout_kl (the full-vocabulary "
                         "KL(μ‖π) per token, see objectives.trm.exact_rollout_kl); or set divergence='sample'")
    return cfg.divergence == "exact" or (cfg.divergence == "auto" and has_exact)


@dataclass
class TRMResult:
    keep: Tensor  # [B] bool; empty sequences are kept (no-op) and excluded from the acceptance rate
    max_div: Tensor  # [B] per-sequence max divergence (-inf for empty sequences)
    mean_div: Tensor  # [B]
    sum_div: Tensor  # [B] (the per-sequence D^seq_KL estimate)
    exact: bool


@torch.no_grad()
def trm_mask(stats: SeqDivergenceStats, cfg: TRMConfig) -> TRMResult:
    """Sequence mask from CP-reduced sequence statistics (see :func:`divergence.seq_divergence_stats`)."""
    exact = uses_exact(cfg, stats.sum_exact is not None)
    if exact:
        max_div, sum_div = stats.max_exact, stats.sum_exact
    else:
        max_div, sum_div = stats.max_k2, stats.sum_k3
    mean_div = sum_div / stats.count.clamp(min=1)
    keep = max_div <= cfg.max_kl
    if cfg.avg_kl is not None:
        keep &= mean_div <= cfg.avg_kl
    keep |= ~stats.nonempty
    return TRMResult(keep, max_div, mean_div, sum_div, exact)


def exact_rollout_kl(anchor_logits: Tensor, rollout_logits: Tensor, *, tp_group=None, vocab_size=None,
                     temperature: float = 1.0, chunk_size=None) -> Tensor:
    """KL(μ(·|c_t) ‖ π_a(·|c_t)) per token over the (TP-sharded) vocabulary, detached — TRM's exact D.

    Both logit tensors ``[*, V_local]`` must be sharded identically. Rollout first (§a.1), i.e.
    ``vocab_parallel_kl(..., direction="forward")`` with the rollout logits as the reference.
    """
    with torch.no_grad():
        return vocab_parallel_kl(anchor_logits.detach(), rollout_logits.detach(), tp_group=tp_group,
                                 direction="forward", vocab_size=vocab_size, temperature=temperature,
                                 chunk_size=chunk_size)
