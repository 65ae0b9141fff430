"""KL penalties to a reference policy (in the reward or in the loss) and the entropy bonus.

Samples come from the policy (y_t ~ π), so with r_t = log π(y_t) − log π_ref(y_t) (clamped to ±20 only
where it is exponentiated, §1.4: k1 and k2 keep their gradient at any |r|):

=========  ===========================================  ======================================
estimator  per-token value                              note
=========  ===========================================  ======================================
k1         r                                            unbiased, can be negative
k2         ½ r²                                         biased, low variance
k3         e^{−r} − 1 + r                               unbiased, >= 0
low_var    k3 clamped to [−10, 10]                      verl's ``low_var_kl``
exact      Σ_v π(v) log(π(v)/π_ref(v)) (full vocab)     ``LossInputs.ref_kl`` (same quantity the dense
                                                        imitation gradient uses, §c)
=========  ===========================================  ======================================

In the loss the value is differentiated through log π_θ (or through the logits for ``exact``); in the
reward it is a detached per-token cost subtracted before advantages are computed.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rl.config.objective import ESTIMATORS, PLACEMENTS, EntropyBonusConfig, KLPenaltyConfig  # noqa: F401
from megatron_rl.objectives.divergence import clamp_log_ratio

Tensor = torch.Tensor






def kl_per_token(logprobs: Tensor, ref_logprobs: Optional[Tensor], estimator: str,
                 exact_kl: Optional[Tensor] = None) -> Tensor:
    """Per-token KL(π‖π_ref) estimate ``[B, T]`` (differentiable through whichever input carries grad)."""
    if estimator == "exact":
        if exact_kl is None:
            raise ValueError("KL estimator 'exact' needs the per-token full-vocabulary KL (LossInputs.ref_kl)")
        return exact_kl
    if ref_logprobs is None:
        raise ValueError(f"KL estimator {estimator!r} needs ref_logprobs (log π_ref of the sampled tokens)")
    r = logprobs - ref_logprobs.detach()
    if estimator == "k1":
        return r
    if estimator == "k2":
        return 0.5 * r.square()
    r = clamp_log_ratio(r)  # before exponentiating only (verl clamps k3's whole log-ratio too)
    k3 = torch.expm1(-r) + r
    return k3.clamp(-10.0, 10.0) if estimator == "low_var" else k3


@torch.no_grad()
def kl_in_reward(token_rewards: Tensor, logprobs: Tensor, ref_logprobs: Optional[Tensor], mask: Tensor,
                 cfg: KLPenaltyConfig, exact_kl: Optional[Tensor] = None) -> Tensor:
    """Per-token rewards minus β·KL (``placement='reward'``), zero outside the mask. ``logprobs`` are the
    rollout-time policy's (π_old). Feed the result to the advantage estimator as token rewards."""
    kl = kl_per_token(logprobs.detach(), ref_logprobs, cfg.estimator, exact_kl)
    zero = torch.zeros((), dtype=token_rewards.dtype, device=token_rewards.device)
    return torch.where(mask.bool(), token_rewards - cfg.coef * kl.to(token_rewards.dtype), zero)
