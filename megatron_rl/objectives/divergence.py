"""Per-token log-ratio estimators and their per-sequence statistics (math_spec §1.1, §e.3).

With λ_t = log π_a(y_t) − log μ(y_t) for y_t ~ μ (Schulman's estimators of KL(μ‖π_a)):
k1 = −λ, k2 = ½λ², k3 = e^λ − 1 − λ. λ is clamped to ±20 first (verl's SAFETY_BOUND); a clamped
token still has k2 = 200 and is rejected by any sane bound, as intended (§a.6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_rl.objectives.reduce import ProcessGroup, seq_max, seq_sum_count

LOG_RATIO_BOUND = 20.0
Tensor = torch.Tensor


def clamp_log_ratio(x: Tensor) -> Tensor:
    return x.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def k1(log_ratio: Tensor) -> Tensor:
    return -log_ratio


def k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio.square()


def k3(log_ratio: Tensor) -> Tensor:
    lr = clamp_log_ratio(log_ratio)
    return torch.expm1(lr) - lr  # expm1 keeps k3 accurate (and >= 0) for tiny |λ|


@dataclass
class SeqDivergenceStats:
    """Per-sequence statistics ``[B]`` of one log-ratio, reduced over context-parallel ranks.

    ``sum_log_ratio`` is Σ_t λ_t of the *unclamped* λ (the log of the sequence ratio ρ(y); clamped only
    where it is exponentiated, math_spec §e.2); ``count`` the valid tokens; ``exact_*`` are filled only
    when a per-token exact divergence was given.
    """

    sum_log_ratio: Tensor
    sum_k2: Tensor
    sum_k3: Tensor
    count: Tensor
    max_k2: Tensor
    max_k3: Tensor
    sum_exact: Optional[Tensor] = None
    max_exact: Optional[Tensor] = None

    @property
    def nonempty(self) -> Tensor:
        return self.count > 0

    @property
    def mean_log_ratio(self) -> Tensor:
        return self.sum_log_ratio / self.count.clamp(min=1)

    def mean(self, what: str) -> Tensor:
        return getattr(self, f"sum_{what}") / self.count.clamp(min=1)


@torch.no_grad()
def seq_divergence_stats(log_ratio: Tensor, valid: Tensor, cp_group: ProcessGroup = None,
                         exact: Optional[Tensor] = None) -> SeqDivergenceStats:
    """All per-sequence sums (one fused AR-SUM) and maxima (one fused AR-MAX) the rollout correction,
    TRM and the mismatch metrics need. ``log_ratio`` is the raw λ: its sequence sum is taken as is (a
    clamp per token would turn λ = (25, −24) into a sum of 0 instead of 1), k2 and k3 per token of the
    clamped λ."""
    raw = log_ratio.detach()
    lr = clamp_log_ratio(raw)
    per_tok = [raw, k2(lr), k3(lr)] + ([exact.detach().to(lr.dtype)] if exact is not None else [])
    sums, count = seq_sum_count(torch.stack(per_tok), valid, cp_group)
    maxes = seq_max(torch.stack(per_tok[1:]), valid, cp_group)
    return SeqDivergenceStats(
        sum_log_ratio=sums[0], sum_k2=sums[1], sum_k3=sums[2], count=count, max_k2=maxes[0], max_k3=maxes[1],
        sum_exact=sums[3] if exact is not None else None, max_exact=maxes[2] if exact is not None else None,
    )
