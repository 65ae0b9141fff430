"""Dense imitation gradient (math_spec §c): β-weighted exact KL to a reference/teacher policy.

Objective J = E_π[R] − β KL(P^{π_θ} ‖ P^{π_ref}); its gradient splits exactly into

* g_dense = −β E[Σ_t ∇κ_t(c_t)], κ_t = KL(π_θ(·|c_t) ‖ π_ref(·|c_t)) — the loss term
  ``β · aggregate(κ)``; the per-token κ comes from ``ops.vocab_parallel_kl`` whose logit gradient is
  the closed form π ⊙ (log π − log π_ref − κ) (reverse) or π − π_ref (forward), no backward collective;
* g_sparse = E[Σ_t ∇log π(y_t) (R − β Σ_{t'>t} κ_{t'} − b_t)] — the policy-gradient term whose
  advantage carries the future-KL *cost-to-go* (:func:`future_kl_cost_to_go`).

Dropping the cost-to-go (``sparse_includes_future_kl=False``) is biased but lower-variance.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rl.config.objective import DenseKLConfig
from megatron_rl.objectives.reduce import ProcessGroup, scan_along_sequence
from megatron_rl.ops import vocab_parallel_kl

Tensor = torch.Tensor




def dense_kl_per_token(logits: Tensor, ref_logits: Tensor, cfg: DenseKLConfig, *, tp_group=None,
                       vocab_size: Optional[int] = None, temperature: float = 1.0,
                       chunk_size: Optional[int] = None) -> Tensor:
    """κ_t per token ``[*]`` from identically sharded student / reference logits ``[*, V_local]``;
    differentiable w.r.t. the student logits only. Goes into ``LossInputs.ref_kl``."""
    return vocab_parallel_kl(logits, ref_logits.detach(), tp_group=tp_group, direction=cfg.direction,
                             vocab_size=vocab_size, temperature=temperature, chunk_size=chunk_size)


def _exclusive_suffix_sum(kl: Tensor, mask: Tensor) -> Tensor:
    x = torch.where(mask, kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
    inclusive = x.flip(-1).cumsum(-1).flip(-1)
    return torch.where(mask, inclusive - x, torch.zeros((), dtype=kl.dtype, device=kl.device))


@torch.no_grad()
def future_kl_cost_to_go(kl: Tensor, mask: Tensor, beta: float, cp_group: ProcessGroup = None) -> Tensor:
    """C_t = β Σ_{t'>t} m_{t'} κ_{t'} ``[B, T]`` (zero outside the mask), detached.

    ``kl`` is the per-token κ of the rollout-time policy (π_old). Under context parallelism pass the
    zigzag-sharded ``[B, T_local]`` tensors and the CP group: the scan runs in sequence order.
    """
    mask = mask.bool()
    return beta * scan_along_sequence(_exclusive_suffix_sum, kl.detach(), mask, cp_group)


@torch.no_grad()
def add_future_kl_cost(advantages: Tensor, kl: Tensor, mask: Tensor, cfg: DenseKLConfig,
                       cp_group: ProcessGroup = None) -> Tensor:
    """Sparse advantage A_t − β Σ_{t'>t} κ_{t'} when enabled (after the reward baseline/normalisation:
    any baseline that depends on the context only keeps the estimator unbiased)."""
    if cfg.beta == 0 or not cfg.sparse_includes_future_kl:
        return advantages
    return advantages - future_kl_cost_to_go(kl, mask, cfg.beta, cp_group).to(advantages.dtype)
