"""What the trainer hands back: :class:`StepResult`, :class:`ForwardResult`, and the merge of the
per-micro-batch metrics of :func:`megatron_rl.objectives.rl_loss` into step metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

Tensor = torch.Tensor


@dataclass
class StepResult:
    """One optimizer step, identical on every rank of the job.

    ``loss`` is the loss of the whole step (all micro-batches and data-parallel ranks: the sum of their
    contributions). ``grad_norm`` is the global norm before clipping. ``skipped``: the loss or the
    gradient was not finite and nothing was updated; ``skipped_steps`` counts such steps so far.
    """

    step: int
    loss: float
    grad_norm: float
    lr: float
    skipped: bool
    skipped_steps: int
    metrics: Dict[str, float] = field(default_factory=dict)


@dataclass
class ForwardResult:
    """Per-response-token statistics ``[B, R]`` of one forward-only pass, aligned with the batch's
    ``response_mask`` (zero outside it), on every rank of the data-parallel replica that ran it.

    ``logprobs`` is the log-prob the loss compares against (DVP-pruned when DVP is on: use it as
    ``old_logprobs``); ``full_logprobs``/``kept_mass``/``target_kept`` only with DVP; ``ref_kl`` only
    with a reference model. MoE batches with ``routed_experts``: ``routing_disagreement`` (pass it on as
    ``TrainBatch.routing_disagreement`` for ``objective.routing_mask``) and ``metrics`` (``routing/*``:
    per-layer agreement, log-prob mismatch vs the rollout; :mod:`megatron_rl.routing`), global over DP.
    """

    logprobs: Tensor
    entropy: Tensor
    sum_pi_squared: Tensor
    response_mask: Tensor
    full_logprobs: Optional[Tensor] = None
    kept_mass: Optional[Tensor] = None
    target_kept: Optional[Tensor] = None
    ref_kl: Optional[Tensor] = None
    routing_disagreement: Optional[Tensor] = None
    metrics: Dict[str, float] = field(default_factory=dict)


def _kind(name: str) -> str:
    if name.startswith(("tokens/", "loss/")) or name.startswith("train/"):
        return "sum"
    leaf = name.rsplit("/", 1)[-1]
    if leaf.startswith("max") or leaf.endswith("_max") or leaf.startswith("bound_"):
        return "max"
    if leaf.endswith("_min"):
        return "min"
    return "mean"


def merge_micro_batch_metrics(per_mb: List[Dict[str, float]]) -> Dict[str, float]:
    """Combine each micro-batch's (already data-parallel-reduced) metrics into step metrics.

    Totals (``tokens/*``, ``loss/*``) add up; maxima/minima (``*max*``, ``*_min``, TRM bounds) take the
    max/min; every other metric is a mean, weighted by each micro-batch's valid-token count
    (exact for token means over valid tokens, an approximation for means over kept tokens or sequences).
    """
    out: Dict[str, float] = {}
    weights = [m.get("tokens/valid", 1.0) for m in per_mb]
    names = sorted({k for m in per_mb for k in m})
    for name in names:
        present = [(m[name], w) for m, w in zip(per_mb, weights) if name in m]
        values = [v for v, _ in present]
        kind = _kind(name)
        if kind == "sum":
            out[name] = float(sum(values))
        elif kind == "max":
            out[name] = float(max(values))
        elif kind == "min":
            out[name] = float(min(values))
        else:
            total = sum(w for _, w in present)
            out[name] = float(sum(v * w for v, w in present) / total) if total > 0 else float(
                sum(values) / len(values))
    return out

