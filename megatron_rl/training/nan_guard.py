"""Whether an Adam(W) step can make the weights non-finite, decided before it is taken, for the price of
one fused reduction folded into the step's existing all-reduce.

For Adam with ``β1² < β2`` started from zero moments, Cauchy–Schwarz bounds every element of the
normalised update whatever the gradients were: ``|m_t| ≤ (1−β1)·sqrt(v_t / ((1−β2)(1−β1²/β2)))``, so

    |m̂_t / (sqrt(v̂_t) + ε)| ≤ C_t = (1−β1) · sqrt(1−β2^t) / ((1−β1^t) · sqrt((1−β2)(1−β1²/β2)))

(``C_t ≤ 7.3`` for the usual 0.9 / 0.999; :func:`adam_update_bound` takes the looser 73, valid at every t) and the decoupled (AdamW) step keeps every weight within
``max|p| · max(1, |1 − lr·wd|) + lr · C_t``. When that bound, with a safety factor, is far below the
largest finite value of the weights' narrowest dtype, the step cannot produce a non-finite weight and no
rollback copy is needed. Otherwise (an absurd learning rate or decay, weights already huge, an optimizer
without Adam's ``betas``) :func:`megatron_rl.training.optim.guarded_step` falls back to the exact
snapshot-and-check path. The gradients do not enter the bound: clipping may happen after it is taken.
"""

from __future__ import annotations

import math
from typing import Iterable, List

import torch

SAFETY = 4.0  # rounding of the moments and of the bound itself, the model-dtype cast: far below needed


def _leaf_groups(optimizer) -> List[dict]:
    groups = []
    for leaf in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(leaf, "optimizer", None)
        if inner is None or getattr(leaf, "is_stub_optimizer", False):
            continue
        groups += inner.param_groups
    return groups


@torch.no_grad()  # a statistic of the weights, never part of a graph
def max_abs_weight(optimizer) -> torch.Tensor:
    """``max |p|`` over this rank's optimizer parameters (the fp32 main copies where they exist) as a 0-d
    float64 tensor on their device: one ``_foreach_norm(inf)`` and a max, no host sync."""
    params = [p for g in _leaf_groups(optimizer) for p in g["params"] if p.numel()]
    if not params:
        return torch.zeros((), dtype=torch.float64)
    norms = torch._foreach_norm(params, float("inf"))
    if len({n.dtype for n in norms}) > 1:
        norms = [n.float() for n in norms]
    return torch.stack(norms).max().double()


def adam_update_bound(beta1: float, beta2: float) -> float:
    """A bound on ``C_t`` for every step ``t`` (``(1−β1)/(1−β1^t) ≤ 1``, ``1−β2^t ≤ 1``); ``inf`` when
    ``β1² ≥ β2`` (no bound)."""
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1) or beta1 * beta1 >= beta2:
        return math.inf
    return 1.0 / math.sqrt((1 - beta2) * (1 - beta1 * beta1 / beta2))


def step_cannot_overflow(optimizer, max_abs: float, model_params: Iterable[torch.Tensor]) -> bool:
    """Whether the next step keeps every weight finite (``max_abs``: all ranks' :func:`max_abs_weight`)."""
    groups = _leaf_groups(optimizer)
    if not math.isfinite(max_abs) or not groups:
        return False
    dtypes = {p.dtype for p in model_params} | {p.dtype for g in groups for p in g["params"]}
    limit = min(torch.finfo(d).max for d in dtypes if d.is_floating_point)
    worst = 0.0
    for g in groups:
        if "betas" not in g or g.get("amsgrad", False) or not g.get("bias_correction", True):
            return False
        lr, wd = float(g["lr"]), float(g.get("weight_decay", 0.0))
        c = adam_update_bound(*map(float, g["betas"]))
        worst = max(worst, max_abs * max(1.0, abs(1.0 - lr * wd)) + abs(lr) * c)
    return SAFETY * worst < limit
