"""The methods' own diagnostics: the gain decomposition of an update (math_spec §h) and the information
a step's rewards carry (§i); both written out for users in docs/report_formulas.md. Pure functions over
full, unsharded driver-side tensors.

Gain decomposition (§h.2). For an update θ → θ′, sequence ratio ρ(τ) = P^θ′(τ)/P^θ(τ) and any baseline
b that depends on the prompt only:

    J(θ′) − J(θ) = E[(R − b)(ρ − 1)] = E[(R − b) log ρ]  +  E[(R − b)(ρ − 1 − log ρ)]
                                       tangent               remainder, |·| <= max|R − b| · KL(P^θ ‖ P^θ′)

Per step (§h.3), on the step's own batch (sampled by μ ≈ π_θ) with log π_θ′ from a forward of the same
batch after the update: ``gain/tangent`` = (1/N) Σ_i (R_i − b_i) Σ_t λ′_t with λ′ = log π_θ′ − log π_θ and
b_i the mean reward of i's group (a per-prompt baseline: the tangent is then the within-prompt
covariance of R and log ρ), ``gain/seq_kl`` = mean_i Σ_t k3(λ′_t) (an unbiased estimate of the sequence
KL), ``gain/slack`` = R_max · seq_kl (the certified bound on the remainder), ``gain/signal_to_slack`` =
tangent / slack: above 1 the first-order gain dominates what the step could lose to curvature. Also
``gain/estimate`` (the importance-sampled J(θ′) − J(θ)) and ``gain/remainder`` = estimate − tangent.

Information (§i): a scalar pass/fail reward teaches at most H(R | prompt) <= 1 bit per episode;
``reward/entropy_bits`` is the empirical entropy of the rewards within each prompt group (of the whole
reward sequence, for per-token rewards), averaged over groups.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Dict, Hashable, Optional, Sequence

import torch

from megatron_rl.config.sections import DiagnosticsConfig  # noqa: F401 - its home before config/sections.py
from megatron_rl.objectives.divergence import clamp_log_ratio

Tensor = torch.Tensor




def _group_mean(values: Tensor, group_ids: Tensor, weights: Tensor) -> Tensor:
    g = torch.unique(torch.as_tensor(group_ids), return_inverse=True)[1].to(values.device)
    n = int(g.max()) + 1 if g.numel() else 0
    num = torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(0, g, weights * values)
    den = torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(0, g, weights)
    return (num / den.clamp(min=1e-300))[g]


@torch.no_grad()
def gain_decomposition(rewards: Sequence[float], group_ids, old_logprobs: Tensor, new_logprobs: Tensor,
                       mask: Tensor, reward_max: Optional[float] = None,
                       weights: Optional[Tensor] = None) -> Dict[str, float]:
    """The ``gain/*`` metrics (see the module docstring) of an update, from per-token log-probs ``[B, T]``
    of the sampled tokens before (θ) and after (θ′) it, sequence rewards ``[B]`` and prompt ids ``[B]``.

    ``weights`` ``[B]``: the probability of each sequence under P^θ(· | its prompt), for an exact expectation
    over an enumerated sequence space (normalised to sum 1 over the batch: prompts weigh equally when each
    group's sum is 1); default uniform (samples from P^θ).
    """
    mask = mask.bool()
    R = torch.as_tensor(rewards, dtype=torch.float64)
    if R.shape != mask.shape[:1]:
        raise ValueError(f"gain_decomposition: {R.numel()} rewards for {mask.shape[0]} sequences")
    nonempty = mask.any(-1)
    w = torch.ones_like(R) if weights is None else torch.as_tensor(weights, dtype=torch.float64).clone()
    w = torch.where(nonempty, w, torch.zeros_like(w))
    if not w.sum() > 0:
        return {}
    lam = torch.where(mask, new_logprobs.double() - old_logprobs.double(), torch.zeros((), dtype=torch.float64))
    log_rho = lam.sum(-1)
    adv = R - _group_mean(R, group_ids, w)  # b: the prompt's mean reward (exact E[R | x] with weights)
    p = w / w.sum()
    tangent = float((p * adv * log_rho).sum())
    estimate = float((p * adv * torch.expm1(clamp_log_ratio(log_rho))).sum())
    lam_c = clamp_log_ratio(lam)
    seq_kl = float((p * torch.where(mask, torch.expm1(lam_c) - lam_c, torch.zeros_like(lam)).sum(-1)).sum())
    r_max = reward_max if reward_max is not None else float(adv[w > 0].abs().max())
    slack = r_max * seq_kl
    out = {"gain/tangent": tangent, "gain/estimate": estimate, "gain/remainder": estimate - tangent,
           "gain/seq_kl": seq_kl, "gain/slack": slack}
    if slack > 0:
        out["gain/signal_to_slack"] = tangent / slack
    return out


def entropy_bits(values: Sequence[Hashable]) -> float:
    """Entropy (bits) of the empirical distribution of ``values``."""
    n = len(values)
    if n == 0:
        return 0.0
    return max(0.0, -sum(c / n * math.log2(c / n) for c in Counter(values).values()))


def reward_entropy_bits(groups: Sequence[Sequence[Hashable]]) -> float:
    """Mean over prompt groups of the entropy (bits) of the rewards within the group; a reward may be a
    number or a tuple (a per-token reward sequence). At most log2(#distinct reward values)."""
    return sum(entropy_bits(g) for g in groups) / len(groups) if groups else 0.0
