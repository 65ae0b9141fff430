"""Loss aggregation: per-token terms -> one scalar, with an explicit denominator (math_spec §a.5, §2.2.5).

Every mode is written as ``loss = Σ_{i,t} e_{i,t} c_{i,t} ℓ_{i,t}`` with detached per-token
coefficients ``c`` (``e`` = tokens that survive every rejection):

====================  ======================================  ======================================
mode                  c_{i,t}                                  D (``total`` / ``kept``)
====================  ======================================  ======================================
token_mean            1 / D                                    valid tokens / surviving tokens
seq_mean_token_sum    1 / D                                    non-empty sequences / sequences with a
                                                               surviving token
seq_mean_token_mean   1 / (n_i D), n_i = tokens of seq i       as above; n_i counts valid (``total``)
                      (over all CP ranks)                      or surviving (``kept``) tokens
fixed                 1 / fixed_denominator                    (e.g. Dr.GRPO: batch × max length)
====================  ======================================  ======================================

``total`` is the TRM paper's normalisation: rejected sequences contribute zero but still count
(4 sequences, 1 rejected, equal contributions ⇒ ¾ of the unmasked loss). ``kept`` is verl's
``agg_loss`` behaviour. D is global over the whole optimisation step: all CP ranks, DP ranks and
micro-batches (see :func:`local_count`), so per-rank / per-micro-batch losses *add up* to the loss
of the unsplit batch and their gradients add up to its gradient.
"""

from __future__ import annotations


import torch

from megatron_rl.config.objective import AGGREGATION_MODES as MODES  # noqa: F401
from megatron_rl.config.objective import DENOMINATORS, AggregationConfig  # noqa: F401
from megatron_rl.objectives.reduce import ProcessGroup, all_reduce, seq_count

Tensor = torch.Tensor




def _counted(valid: Tensor, keep: Tensor, cfg: AggregationConfig) -> Tensor:
    return valid if cfg.denominator == "total" else keep


@torch.no_grad()
def local_count(valid: Tensor, keep: Tensor, cfg: AggregationConfig, cp_group: ProcessGroup = None,
                dtype: torch.dtype = torch.float32) -> Tensor:
    """This micro-batch's share of the denominator D (a 0-dim tensor, equal on all CP ranks).

    Sum it over the step's micro-batches, then over DP (:func:`finish_denominator`). Tokens are summed
    over CP; a sequence split over CP ranks is counted once (from its CP-reduced token count).
    """
    m = _counted(valid, keep, cfg)
    if cfg.mode == "fixed":
        return torch.zeros((), dtype=dtype, device=valid.device)
    if cfg.mode == "token_mean":
        return all_reduce(m.sum(dtype=dtype).reshape(1), "sum", cp_group)[0]
    return (seq_count(m, cp_group, dtype) > 0).sum().to(dtype)


@torch.no_grad()
def finish_denominator(count: Tensor, cfg: AggregationConfig, dp_group: ProcessGroup = None) -> Tensor:
    """Global D from the summed micro-batch counts: AR-SUM over DP, clamped to >= 1 so an empty step
    yields an exact, graph-attached zero loss rather than 0/0."""
    if cfg.mode == "fixed":
        return torch.tensor(float(cfg.fixed_denominator), dtype=count.dtype, device=count.device)
    return all_reduce(count.detach().clone().reshape(1).contiguous(), "sum", dp_group)[0].clamp(min=1)


@torch.no_grad()
def token_coefficients(valid: Tensor, keep: Tensor, cfg: AggregationConfig, denominator: Tensor,
                       cp_group: ProcessGroup = None) -> Tensor:
    """Detached per-token coefficients ``e·c`` (zero wherever the token does not survive)."""
    dt = denominator.dtype
    c = torch.where(keep, torch.ones((), dtype=dt, device=keep.device), torch.zeros((), dtype=dt, device=keep.device))
    if cfg.mode == "seq_mean_token_mean":
        n = seq_count(_counted(valid, keep, cfg), cp_group, dt).clamp(min=1)
        c = c / n[:, None]
    return c / denominator


def aggregate(values: Tensor, keep: Tensor, coef: Tensor) -> Tensor:
    """``Σ e·c·ℓ`` — a 0-dim tensor that stays attached to the graph even when nothing survives."""
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    return torch.where(keep, values * coef.to(values.dtype), zero).sum()
