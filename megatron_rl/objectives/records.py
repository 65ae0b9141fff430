"""Typed per-token records consumed by every objective (design practice 5).

Layout choice: **padded** ``[B, T]`` tensors, one row per response, plus a boolean loss mask. Packed
(THD) batches are unpacked to this layout before the loss (a cheap index op on per-token scalars,
never on logits). Under context parallelism each rank passes ``[B, T_local]``: its own positions of
the same ``B`` sequences (see :mod:`megatron_rl.objectives.reduce`).

Every log-prob is of the sampled token ``y_t`` at position ``t`` (already temperature-scaled and,
with DVP, already pruned-and-renormalised on *both* sides of every ratio, math_spec §b.2).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Dict, Optional, Tuple

import torch

Tensor = torch.Tensor

@dataclass(kw_only=True)
class BatchTokens:
    """The per-token ``[B, R]`` fields a training batch carries from the driver into the loss, declared once:
    :class:`~megatron_rl.training.TrainBatch` and :class:`~megatron_rl.training.micro_batch.MicroBatch` inherit
    them, and each micro-batch hands them to :class:`LossInputs` (same names, documented there) by
    :func:`batch_tokens`. A new per-token input is one line here (and its use in the loss).
    """

    advantages: Optional[Tensor] = None
    rollout_logprobs: Optional[Tensor] = None
    old_logprobs: Optional[Tensor] = None
    ref_logprobs: Optional[Tensor] = None
    routing_disagreement: Optional[Tensor] = None
    policy_version: Optional[Tensor] = None


BATCH_TOKEN_FIELDS = tuple(f.name for f in fields(BatchTokens))


def batch_tokens(record: BatchTokens) -> Dict[str, Optional[Tensor]]:
    """The record's per-token fields by name (for the next record on the way to the loss)."""
    return {name: getattr(record, name) for name in BATCH_TOKEN_FIELDS}


# Float per-token fields checked for non-finite values at valid positions (math_spec §1.4).
_FLOAT_FIELDS = ("logprobs", "advantages", "old_logprobs", "rollout_logprobs", "ref_logprobs", "entropy",
                 "sum_pi_squared", "rollout_kl", "rollout_tv", "ref_kl", "kept_mass", "routing_disagreement")


@dataclass
class LossInputs:
    """Per-token loss inputs, all ``[B, T]`` (``T`` = this rank's positions under CP).

    Attributes:
        logprobs: log π_θ(y_t | c_t) of the policy being optimised. Differentiable.
        mask: loss mask (bool): 1 for model-generated response tokens, 0 for padding, prompt and
            tool/observation tokens.
        advantages: per-token advantages (detached). Never a per-sequence ``[B]`` scalar: the loss does
            not broadcast, so dense signals (OTB baselines, per-token KL costs, process rewards) survive
            (math_spec §i).
        old_logprobs: log π_old (proximal policy, the trainer's forward pass at the start of the step).
            Required in decoupled mode, unused in bypass mode.
        rollout_logprobs: log μ (behaviour policy, recorded by the rollout engine). Enables rollout
            correction and TRM.
        ref_logprobs: log π_ref of the sampled token (sample-based KL penalties k1/k2/k3).
        entropy: H(π_θ(·|c_t)) (differentiable) for the entropy bonus and metrics.
        sum_pi_squared: Σ_v π_θ(v|c_t)² (no grad), for the logit-gradient-proxy metric (math_spec §d).
        rollout_kl: exact KL(μ(·|c_t) ‖ π_anchor(·|c_t)) over the full vocabulary (no grad), for TRM's
            exact path (``ops.vocab_parallel_kl(anchor_logits, rollout_logits, direction="forward")``).
        rollout_tv: exact TV(μ(·|c_t), π_anchor(·|c_t)) per token (no grad; ``with_tv=True`` of the same op),
            only for TRM's bound metrics (ε and the adaptive bound); Pinsker's bound on ``rollout_kl``
            is used without it.
        ref_kl: exact per-token KL between π_θ and π_ref (differentiable w.r.t. π_θ only), the dense
            imitation term (``ops.vocab_parallel_kl(logits, ref_logits)``).
        kept_mass: DVP kept mass Z_K of the trainer's safe set (no grad).
        target_kept: DVP: whether y_t lies in the trainer's safe set K (bool).
        routing_disagreement: MoE: fraction of MoE layers whose top-k expert set at the position predicting
            y_t differs between the trainer and the rollout engine (no grad), for
            ``ObjectiveConfig.routing_mask``.
        policy_version: int64, the weight version that sampled y_t (asynchronous RL: a partial rollout paused
            across a weight update spans versions). Every correction is per token already -- ``rollout_logprobs``
            holds each token's own behaviour log-prob from the weights that produced it, so TIS/MIS/TRM and
            decoupled PPO correct a version-spanning sequence token by token; the version feeds the
            ``versions/`` metrics.
    """

    logprobs: Tensor
    mask: Tensor
    advantages: Tensor
    old_logprobs: Optional[Tensor] = None
    rollout_logprobs: Optional[Tensor] = None
    ref_logprobs: Optional[Tensor] = None
    entropy: Optional[Tensor] = None
    sum_pi_squared: Optional[Tensor] = None
    rollout_kl: Optional[Tensor] = None
    rollout_tv: Optional[Tensor] = None
    ref_kl: Optional[Tensor] = None
    kept_mass: Optional[Tensor] = None
    target_kept: Optional[Tensor] = None
    routing_disagreement: Optional[Tensor] = None
    policy_version: Optional[Tensor] = None

    def __post_init__(self) -> None:
        if self.logprobs.dim() != 2:
            raise ValueError(f"LossInputs.logprobs must be [B, T]; got shape {tuple(self.logprobs.shape)}")
        shape = self.logprobs.shape
        if self.advantages.shape != shape:
            raise ValueError(
                f"LossInputs.advantages has shape {tuple(self.advantages.shape)}, expected per-token {tuple(shape)}; "
                "broadcast a per-sequence advantage to its tokens before the loss (adv[:, None] * mask)"
            )
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None and f.name != "advantages" and v.shape != shape:
                raise ValueError(
                    f"LossInputs.{f.name} has shape {tuple(v.shape)}, expected {tuple(shape)} like logprobs")
        if self.mask.dtype != torch.bool:
            self.mask = self.mask.bool()
        if self.target_kept is not None and self.target_kept.dtype != torch.bool:
            self.target_kept = self.target_kept.bool()

    def sanitized(self) -> Tuple["LossInputs", Tensor, Tensor]:
        """Copy with every float field zeroed where the token is not valid (and half precision upcast to
        fp32), the valid mask, and the number of tokens dropped for carrying a non-finite value.

        A token marked valid whose inputs contain NaN or ±inf is removed from the loss (and counted):
        it is a data defect, and ``nan * 0 = nan`` would otherwise leak through masks. ``torch.where``
        (not multiplication) keeps the gradient of every dropped position exactly zero.
        """
        valid = self.mask.clone()
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if v is not None:
                valid &= torch.isfinite(v.detach())
        n_bad = (self.mask & ~valid).sum()
        clean = {}
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if v is not None:
                if v.dtype in (torch.bfloat16, torch.float16):  # loss math in fp32 (grads flow back in bf16)
                    v = v.float()
                clean[name] = torch.where(valid, v, torch.zeros((), dtype=v.dtype, device=v.device))
        return replace(self, mask=valid, **clean), valid, n_bad
