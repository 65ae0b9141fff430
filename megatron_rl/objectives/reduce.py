"""Sequence and batch reductions across context-parallel ranks, micro-batches and data-parallel ranks.

This is the only module under ``objectives/`` that calls ``torch.distributed`` (math_spec §1.3, §2.1).
Every function takes its process groups explicitly; ``None`` (or a group of one rank) means "no
reduction", so the same code runs unsharded.

Conventions
-----------
* Tensors are padded ``[B, T_local]``: on a context-parallel (CP) rank, row ``b`` holds *that rank's*
  positions of sequence ``b`` (Megatron's zigzag chunks); every CP rank holds the same ``B`` sequences.
  Without CP, ``T_local = T``. Sums, means and maxima only need each rank's tokens to be disjoint, so
  they also serve the trainer's layout (``ReduceGroups.cp_zigzag=False``): every CP rank holds all
  ``T`` response columns and its own tokens are the ones its mask selects.
* Reductions here are over **detached** statistics. The differentiable part of every loss is
  token-local, so no collective ever needs a backward; that is what makes per-rank loss contributions
  simply add up across CP ranks and micro-batches.
* sum: local masked partial sum -> AR-SUM over CP. mean: AR-SUM of the pair (sum, count), divided
  afterwards (never an average of per-rank means). max: masked max with -inf fill -> AR-MAX; -inf
  means "the sequence has no valid token".
* Statistics are accumulated in float32 (float64 if the input is float64), whatever the input dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

ProcessGroup = Optional[dist.ProcessGroup]


@dataclass(frozen=True)
class ReduceGroups:
    """The groups a loss reduces over. ``cp``: ranks holding other positions of the *same*
    sequences. ``dp``: ranks holding *other* sequences of the same optimisation step (Megatron's data
    parallel group without CP). ``cp_zigzag``: the columns of a ``[B, T_local]`` tensor are this rank's
    zigzag chunks (True) or every position, this rank's tokens selected by the mask (False); only
    position-indexed statistics (:func:`cp_positions`, :func:`position_mean`) read it."""

    cp: ProcessGroup = None
    dp: ProcessGroup = None
    cp_zigzag: bool = True

    @property
    def cp_columns(self) -> ProcessGroup:
        """The CP group to pass to position-indexed helpers: None when columns are positions already."""
        return self.cp if self.cp_zigzag else None


def stat_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64; everything else is reduced in float32 (bf16 sums lose tokens)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _active(group: ProcessGroup) -> bool:
    return group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def all_reduce(x: torch.Tensor, op: str, *groups: ProcessGroup) -> torch.Tensor:
    """All-reduce ``x`` (in place, returned) over each group in turn; ``op`` is "sum" or "max"."""
    red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    for g in groups:
        if _active(g):
            dist.all_reduce(x, op=red, group=g)
    return x


@torch.no_grad()
def seq_sum_count(x: torch.Tensor, mask: torch.Tensor, cp_group: ProcessGroup = None):
    """Per-sequence masked sums of ``x`` ``[B, T]`` (or ``[K, B, T]``: K statistics fused into one
    all-reduce) and the per-sequence valid-token count ``[B]``, reduced over CP."""
    dt = stat_dtype(x)
    xs = x.detach().to(dt)
    stacked = xs if xs.dim() == 3 else xs.unsqueeze(0)
    sums = torch.where(mask, stacked, torch.zeros((), dtype=dt, device=x.device)).sum(-1)  # [K, B]
    buf = torch.cat([sums, mask.sum(-1, dtype=dt).unsqueeze(0)], 0).contiguous()
    all_reduce(buf, "sum", cp_group)
    s = buf[:-1] if xs.dim() == 3 else buf[0]
    return s, buf[-1]


@torch.no_grad()
def seq_count(mask: torch.Tensor, cp_group: ProcessGroup = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Number of valid tokens of each sequence ``[B]``, over all CP ranks."""
    return all_reduce(mask.sum(-1, dtype=dtype).contiguous(), "sum", cp_group)


@torch.no_grad()
def seq_sum(x: torch.Tensor, mask: torch.Tensor, cp_group: ProcessGroup = None) -> torch.Tensor:
    return seq_sum_count(x, mask, cp_group)[0]


@torch.no_grad()
def seq_mean(x: torch.Tensor, mask: torch.Tensor, cp_group: ProcessGroup = None) -> torch.Tensor:
    """Per-sequence masked mean ``[B]`` (0 for a sequence without valid tokens)."""
    s, n = seq_sum_count(x, mask, cp_group)
    return s / n.clamp(min=1)


@torch.no_grad()
def seq_max(x: torch.Tensor, mask: torch.Tensor, cp_group: ProcessGroup = None) -> torch.Tensor:
    """Per-sequence masked max ``[B]`` (or ``[K, B]`` for stacked ``[K, B, T]``); -inf = no valid token."""
    dt = stat_dtype(x)
    xs = x.detach().to(dt)
    ninf = torch.full((), -torch.inf, dtype=dt, device=x.device)
    m = torch.where(mask, xs, ninf).amax(-1) if xs.shape[-1] > 0 else ninf.expand(xs.shape[:-1]).clone()
    return all_reduce(m.contiguous(), "max", cp_group)


@torch.no_grad()
def global_sum(x: torch.Tensor, *groups: ProcessGroup) -> torch.Tensor:
    """A copy of ``x`` summed over every group given (e.g. ``cp`` then ``dp`` for token counts)."""
    return all_reduce(x.detach().clone().contiguous(), "sum", *groups)


@torch.no_grad()
def global_max(x: torch.Tensor, *groups: ProcessGroup) -> torch.Tensor:
    return all_reduce(x.detach().clone().contiguous(), "max", *groups)


@torch.no_grad()
def global_mean_response_length(mask: torch.Tensor, dp_group: ProcessGroup = None,
                                cp_group: ProcessGroup = None) -> float:
    """Mean number of model-generated tokens per non-empty response over the whole step (all DP ranks).

    ``mask`` marks model-generated tokens (tool/observation tokens excluded): this is the response
    length the length-surge LR schedule reads (math_spec §g.2). Identical on every rank.
    """
    n = seq_count(mask, cp_group, torch.float64)
    buf = torch.stack([n.sum(), (n > 0).sum().to(torch.float64)])
    all_reduce(buf, "sum", dp_group)
    return float(buf[0] / buf[1].clamp(min=1))


def broadcast_scalar(value: float, group: ProcessGroup = None, src_rank_in_group: int = 0) -> float:
    """Broadcast a python float from one rank of ``group`` to all (the LR computed once, used everywhere)."""
    if not _active(group):
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.broadcast(t, src=dist.get_global_rank(group, src_rank_in_group), group=group)
    return float(t.item())


# ----------------------------------------------------------------------------------------------
# Zigzag context-parallel layout (Megatron ``get_batch_on_this_cp_rank``): the sequence axis is cut
# into 2*P equal chunks and rank r holds chunks r and 2P-1-r, concatenated. Needed only for scans
# along the sequence (cost-to-go, OTB prefix sums), where rank order is not sequence order.
# ----------------------------------------------------------------------------------------------


def zigzag_split(full: torch.Tensor, cp_size: int, cp_rank: int, dim: int = -1) -> torch.Tensor:
    """This CP rank's part of ``full``; ``full.shape[dim]`` must be divisible by ``2 * cp_size``."""
    n = full.shape[dim]
    if n % (2 * cp_size):
        raise ValueError(f"sequence length {n} is not divisible by 2*cp_size = {2 * cp_size}; pad the batch to a "
                         f"multiple of {2 * cp_size}")
    chunks = full.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=dim)


@torch.no_grad()
def zigzag_gather(local: torch.Tensor, cp_group: ProcessGroup, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`zigzag_split` over the CP group: every rank gets the full tensor (detached)."""
    if not _active(cp_group):
        return local.detach().clone()
    if local.dtype == torch.bool:  # not every backend gathers bool
        return zigzag_gather(local.to(torch.uint8), cp_group, dim).bool()
    p = dist.get_world_size(cp_group)
    parts = [torch.empty_like(local) for _ in range(p)]
    dist.all_gather(parts, local.detach().contiguous(), group=cp_group)
    chunks: list = [None] * (2 * p)
    for r, part in enumerate(parts):
        a, b = part.chunk(2, dim=dim)
        chunks[r], chunks[2 * p - 1 - r] = a, b
    return torch.cat(chunks, dim=dim)


def cp_positions(t_local: int, cp_group: ProcessGroup = None, device=None) -> torch.Tensor:
    """Sequence position ``[T_local]`` (long) of each local column under the zigzag layout."""
    if not _active(cp_group):
        return torch.arange(t_local, device=device)
    p = dist.get_world_size(cp_group)
    return zigzag_split(torch.arange(t_local * p, device=device), p, dist.get_rank(cp_group))


@torch.no_grad()
def position_mean(x: torch.Tensor, mask: torch.Tensor, cp_group: ProcessGroup = None,
                  dp_group: ProcessGroup = None, zigzag: bool = True) -> torch.Tensor:
    """Mean of ``x`` over the valid tokens at each sequence position, over all CP and DP ranks:
    ``[T_max]`` with T_max the global padded length (0 where no sequence reaches a position).
    Two collectives over DP (the padded lengths may differ between DP ranks) and one over CP.
    ``zigzag=False``: the columns are positions already (``ReduceGroups.cp_zigzag``)."""
    dt = stat_dtype(x)
    t_local = x.shape[-1]
    cp = dist.get_world_size(cp_group) if _active(cp_group) and zigzag else 1
    t_max = int(all_reduce(torch.tensor([t_local * cp], device=x.device), "max", dp_group)[0])
    buf = torch.zeros(2, t_max, dtype=dt, device=x.device)
    pos = cp_positions(t_local, cp_group if zigzag else None, x.device)
    zero = torch.zeros((), dtype=dt, device=x.device)
    buf[0].index_add_(0, pos, torch.where(mask, x.detach().to(dt), zero).sum(0))
    buf[1].index_add_(0, pos, mask.sum(0).to(dt))
    all_reduce(buf, "sum", cp_group, dp_group)
    return buf[0] / buf[1].clamp(min=1)


@torch.no_grad()
def scan_along_sequence(fn, local: torch.Tensor, mask: torch.Tensor, cp_group: ProcessGroup = None) -> torch.Tensor:
    """Apply a sequence-order scan ``fn(full_x, full_mask) -> full_y`` (``[B, T]``) to zigzag-sharded
    ``local`` ``[B, T_local]``: all-gather inside CP, compute, keep this rank's part (miles' approach,
    math_spec §1.3). Without CP it is just ``fn(local, mask)``. Detached: scans feed advantages only."""
    if not _active(cp_group):
        return fn(local.detach(), mask)
    full = fn(zigzag_gather(local, cp_group), zigzag_gather(mask, cp_group))
    return zigzag_split(full, dist.get_world_size(cp_group), dist.get_rank(cp_group))
