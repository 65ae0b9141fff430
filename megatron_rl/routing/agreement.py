"""Routing agreement between the trainer and the rollout engine, and the log-prob mismatch.

Which routing belongs to a response token. The log-prob of response token ``j`` comes from the logits
at position ``P - 1 + j`` (``MicroBatch.logit_index``); the routing *at that position* (all MoE layers)
is compared. Those positions never include the last token, whose routing SGLang does not return.
Positions where the engine's row is ``FREE`` or the token is outside ``response_mask`` are skipped.

Two tokens' routing "agree" at a layer when their top-k expert *sets* are equal (the order of the k
ids is not meaningful). Per layer, the agreement is the fraction of compared tokens that agree; per
token, the disagreement is the fraction of MoE layers that differ (the routing mask's input).

Which trainer routing. Without replay: the trainer's actual routing. With replay: the experts each of
the trainer's routers would have picked itself given the replayed upstream routing (recorded alongside
replay at no extra forward) — a per-layer measure that does not compound over layers.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_rl.models.router import FREE, tokens_to_batch_major
from megatron_rl.objectives.divergence import clamp_log_ratio, k3

Tensor = torch.Tensor


def same_sets(a: Tensor, b: Tensor) -> Tensor:
    """``[..., k]`` x ``[..., k]`` -> ``[...]`` bool: equal as sets of k distinct ids."""
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


def reduce_sum(t: Tensor, *groups) -> Tensor:
    """Sum ``t`` (a CPU tensor) over each group of size > 1, in place; through CUDA on NCCL groups."""
    for g in groups:
        if g is None or dist.get_world_size(g) == 1:
            continue
        if dist.get_backend(g) == "nccl":
            moved = t.cuda()
            dist.all_reduce(moved, group=g)
            t.copy_(moved.cpu())
        else:
            dist.all_reduce(t, group=g)
    return t


class AgreementTracker:
    """Accumulates one pass's agreement counts; :meth:`finalize` reduces them over PP and DP.

    ``moe_layers``: the model's MoE layers (global indices) in order, matching the third dimension of
    ``routed_experts``.
    """

    def __init__(self, batch_size: int, response_width: int, moe_layers: Sequence[int],
                 device: Optional[torch.device] = None) -> None:
        self.moe_layers = list(moe_layers)
        self._index = {layer: i for i, layer in enumerate(self.moe_layers)}
        # counts live where the micro-batches are (the trainer's device): no copy per micro-batch and layer
        kw = dict(dtype=torch.float64, device=device)
        self.tokens = torch.zeros(2, batch_size, response_width, **kw)  # [differing, compared]
        self.layers = torch.zeros(len(self.moe_layers), 2, **kw)  # [agreeing, compared]

    def add(self, mb, own: Dict[int, Tensor]) -> None:
        """One micro-batch: ``own`` = ``{global layer: [s*b, topk]}`` trainer ids (sequence-major)."""
        if mb.routed_experts is None:
            raise ValueError("routing agreement needs TrainBatch.routed_experts")
        b, s = mb.input_ids.shape  # this rank's positions (padded rows or one packed stream)
        r = mb.logit_index.shape[1]
        for layer, ids in own.items():
            i = self._index[layer]
            mine = tokens_to_batch_major(ids.detach(), b)  # [b, s, k]
            theirs = mb.routed_experts[:, :, i]
            if mine.shape != theirs.shape:
                raise ValueError(f"routing agreement, layer {layer}: trainer ids {tuple(mine.shape)} vs engine ids "
                                 f"{tuple(theirs.shape)}")
            k = mine.shape[-1]
            mine, theirs = mine.reshape(b * s, k)[mb.logit_index], theirs.reshape(b * s, k)[mb.logit_index]  # [n, r, k]
            compared = mb.response_mask & (theirs[..., 0] != FREE)
            agree = same_sets(mine, theirs) & compared
            self.layers[i, 0] += agree.sum()
            self.layers[i, 1] += compared.sum()
            self.tokens[0, mb.rows, :r] += (compared & ~agree).double()
            self.tokens[1, mb.rows, :r] += compared.double()

    def collect(self, order: List, record) -> None:
        """Add a pass's routing: ``order`` = the micro-batches in forward order, ``record`` a
        :class:`~megatron_rl.models.router.RoutingRecord` with one call per forward and local layer."""
        for layer, calls in record.calls.items():
            if len(calls) != len(order):
                raise RuntimeError(f"routing agreement, layer {layer}: {len(calls)} recorded router calls for "
                                   f"{len(order)} micro-batches")
        for k, mb in enumerate(order):
            self.add(mb, {layer: calls[k] for layer, calls in record.calls.items()})

    def finalize(self, groups, prefix: str = "routing/",
                 tokens: bool = True) -> Tuple[Optional[Tensor], Dict[str, float]]:
        """``(per-token disagreement [B, R] float32 or None, metrics)``; collective over the PP and CP
        groups (tokens) and PP + DP + CP (metrics). Metrics: ``{prefix}agreement_layer{i}`` (i the global layer
        index) and ``{prefix}agreement_mean`` (over all compared (token, layer) pairs)."""
        reduce_sum(self.layers, groups.pp, groups.dp, groups.cp)  # CP ranks compare disjoint tokens
        metrics: Dict[str, float] = {}
        for layer, (agree, total) in zip(self.moe_layers, self.layers.tolist()):
            if total > 0:
                metrics[f"{prefix}agreement_layer{layer}"] = agree / total
        total = float(self.layers[:, 1].sum())
        if total > 0:
            metrics[f"{prefix}agreement_mean"] = float(self.layers[:, 0].sum()) / total
        disagreement = None
        if tokens:
            reduce_sum(self.tokens, groups.pp, groups.cp)
            disagreement = (self.tokens[0] / self.tokens[1].clamp(min=1)).float().cpu()  # for the driver
        return disagreement, metrics


def mismatch_sums(logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``[Σ|λ|, Σ k3(λ), count]`` (float64) over ``mask`` tokens with finite values, λ = log π − log μ."""
    lr = logprobs.detach().double() - rollout_logprobs.detach().double()
    ok = mask & torch.isfinite(lr)
    lr = clamp_log_ratio(torch.where(ok, lr, torch.zeros((), dtype=lr.dtype)))
    return torch.stack([lr.abs()[ok].sum(), k3(lr)[ok].sum(), ok.sum().double()])


def mismatch_metrics(sums: Tensor, prefix: str = "routing/") -> Dict[str, float]:
    """Reduced :func:`mismatch_sums` -> ``{prefix}logprob_abs_diff`` and ``{prefix}mismatch_k3``."""
    abs_sum, k3_sum, n = sums.tolist()
    if n <= 0:
        return {}
    return {f"{prefix}logprob_abs_diff": abs_sum / n, f"{prefix}mismatch_k3": k3_sum / n}
