"""The RL loss: selection (masks, IS weights) → per-token terms → aggregation, as one pure function.

    loss = Σ e·c·[ w·ℓ_PG + β_KL·KL_t + β_dense·κ_t − α·H_t ]

with e the surviving tokens, c the aggregation coefficients (:mod:`aggregate`), w the detached rollout
correction weights. Rejected tokens/sequences are removed from *every* term (they still count in a
``total`` denominator).

Splitting contract: the value returned on a rank is that rank's *contribution*. Contributions of the
CP ranks, DP ranks and micro-batches of one step add up to the loss of the unsplit batch, and their
gradients add up to its gradient, provided every piece uses the step's :class:`Normalizer` (compute
it once with :func:`step_normalizer` over all micro-batches; a single micro-batch computes its own).
Under Megatron, whose DDP averages gradients over the data-parallel(+CP) group, scale the returned
loss by that group's size before backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

from megatron_rl.objectives.aggregate import aggregate, finish_denominator, local_count, token_coefficients
from megatron_rl.config.objective import ObjectiveConfig
from megatron_rl.objectives.kl_penalty import kl_per_token
from megatron_rl.objectives.metrics import objective_metrics
from megatron_rl.objectives.policy_loss import policy_token_loss
from megatron_rl.objectives.records import LossInputs
from megatron_rl.objectives.reduce import ReduceGroups, all_reduce, seq_count
from megatron_rl.objectives.selection import Selection, select_tokens

Tensor = torch.Tensor
_IS_MEAN_FLOOR = 1e-8  # verl: skip batch normalisation when the mean weight is this small


@dataclass
class Normalizer:
    """Step-global quantities every micro-batch must share.

    ``denominator``: D of the aggregation mode (0-dim, >= 1). ``is_weight_mean``: divisor of the IS
    weights under ``is_batch_normalize`` (mean over the step's surviving tokens, or sequences), else 1.
    """

    denominator: Tensor
    is_weight_mean: Tensor


@torch.no_grad()
def _normalizer(sels: Sequence[Selection], cfg: ObjectiveConfig, groups: ReduceGroups) -> Normalizer:
    count = sum(local_count(s.valid, s.keep, cfg.aggregation, groups.cp, torch.float64) for s in sels)
    denominator = finish_denominator(torch.as_tensor(count, dtype=torch.float64), cfg.aggregation, groups.dp)
    one = torch.ones((), dtype=torch.float64, device=denominator.device)
    if not cfg.correction.is_batch_normalize:
        return Normalizer(denominator, one)
    buf = torch.zeros(2, dtype=torch.float64, device=denominator.device)
    for s in sels:
        if cfg.correction.is_level == "token":
            w = torch.where(s.keep, s.weights.double(), torch.zeros((), dtype=torch.float64, device=s.keep.device))
            buf += all_reduce(torch.stack([w.sum(), s.keep.sum().double()]), "sum", groups.cp)
        else:  # per-sequence weights, each sequence once (already CP-complete)
            kept = seq_count(s.keep, groups.cp) > 0
            buf += torch.stack([torch.where(kept, s.seq_weights.double(), 0.0).sum(), kept.sum().double()])
    all_reduce(buf, "sum", groups.dp)
    mean = buf[0] / buf[1].clamp(min=1)
    return Normalizer(denominator, torch.where(mean > _IS_MEAN_FLOOR, mean, one))


def step_normalizer(micro_batches: Sequence[LossInputs], cfg: ObjectiveConfig,
                    groups: ReduceGroups = ReduceGroups()) -> Normalizer:
    """The :class:`Normalizer` of a whole step from all of this rank's micro-batches (collectives over
    ``groups``; call it on every rank). In bypass mode selections depend on the current log-probs, so
    pass the micro-batches with the log-probs the loss will see, or use ``total`` denominators."""
    return _normalizer([select_tokens(mb, cfg, groups) for mb in micro_batches], cfg, groups)


def rl_loss(inputs: LossInputs, cfg: ObjectiveConfig, groups: ReduceGroups = ReduceGroups(),
            normalizer: Optional[Normalizer] = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Loss contribution of this rank's micro-batch and its metrics (see the module docstring)."""
    sel = select_tokens(inputs, cfg, groups)
    if normalizer is None:
        normalizer = _normalizer([sel], cfg, groups)
    x, keep = sel.inputs, sel.keep
    coef = token_coefficients(sel.valid, keep, cfg.aggregation, normalizer.denominator, groups.cp)

    term = policy_token_loss(x.logprobs, sel.anchor, x.advantages, keep, cfg.policy, groups.cp)
    weights = (sel.weights.double() / normalizer.is_weight_mean).to(term.loss.dtype)
    parts = {"pg": aggregate(term.loss * weights, keep, coef)}
    loss = parts["pg"]
    if cfg.kl_penalty.in_loss:
        kl = kl_per_token(x.logprobs, x.ref_logprobs, cfg.kl_penalty.estimator, x.ref_kl)
        parts["kl"] = aggregate(kl, keep, coef)
        loss = loss + cfg.kl_penalty.coef * parts["kl"]
    if cfg.dense_kl.beta > 0:
        if x.ref_kl is None:
            raise ValueError("dense_kl.beta > 0 needs LossInputs.ref_kl (per-token exact KL to the reference, "
                             "objectives.dense_kl.dense_kl_per_token)")
        parts["dense_kl"] = aggregate(x.ref_kl, keep, coef)
        loss = loss + cfg.dense_kl.beta * parts["dense_kl"]
    if cfg.entropy.coef > 0:
        if x.entropy is None:
            raise ValueError("entropy.coef > 0 needs LossInputs.entropy (ops.vocab_parallel_stats(...).entropy)")
        parts["entropy"] = aggregate(x.entropy, keep, coef)
        loss = loss - cfg.entropy.coef * parts["entropy"]
    parts["total"] = loss
    metrics = objective_metrics(sel, term, normalizer.is_weight_mean, parts, cfg, groups)
    return loss, metrics
