"""Token-budget micro-batches, balanced over data-parallel ranks (deterministic, pure functions).

RL batches are long-tailed: a fixed number of sequences per micro-batch either wastes compute on padding
or runs out of memory on the longest responses. With ``train.max_tokens_per_micro_batch = C`` the
sequences of a rank are packed into as few micro-batches as the hard cap allows (each packed stream,
rounded up to its multiple, at most ``C · cp`` tokens: ``C`` per context-parallel rank), and the
estimated work is balanced over them.

Work of a sequence of ``L`` tokens: ``a·L + b·L²`` (:class:`WorkModel`; from the architecture, the
matmul FLOPs per token and the causal attention's per pair). Two levels:

* :func:`assign_to_ranks` — the driver's split of a step's batch over data-parallel ranks: longest work
  first, each sequence to the least-loaded rank that still has room for its share of the count (every
  rank gets ``B / dp`` sequences, as an equal split would). Bound: max rank work ≤ mean + the largest
  single sequence's work.
* :func:`pack` — one rank's sequences into micro-batches: longest work first, each to the least-loaded
  micro-batch with room under the cap; the fewest micro-batches this greedy finds, or exactly ``count``
  (every DP rank must run the same number: expert-parallel all-to-alls and pipeline schedules pair the
  ranks' micro-batches). If the greedy cannot fill ``count`` bins it splits the fullest bins of the
  smallest feasible packing, which always works while ``count`` ≤ the number of sequences.

Ties break on the sequence index: the same lengths give the same plan on every rank and every run.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch


@dataclass(frozen=True)
class WorkModel:
    """Estimated cost ``a·L + b·L²`` of one sequence of ``L`` tokens (any unit; only ratios matter)."""

    a: float = 1.0
    b: float = 0.0

    @classmethod
    def from_arch(cls, arch) -> "WorkModel":
        """Per token: 2 FLOPs per weight it touches (attention, the active MLP experts, the output layer);
        per causal pair: ``QKᵀ`` and ``PV`` over all heads, ``2 · 2 · heads · head_dim / 2`` per layer."""
        h, d = arch.hidden_size, arch.num_heads * arch.head_dim
        attn = h * (d + 2 * arch.num_kv_heads * arch.head_dim) + d * h
        mlp = 3 * h * (arch.moe_topk * arch.moe_ffn_hidden_size if arch.is_moe else arch.ffn_hidden_size)
        a = 2.0 * (arch.num_layers * (attn + mlp) + h * arch.vocab_size)
        return cls(a=a, b=2.0 * arch.num_layers * d)

    def __call__(self, lengths: Sequence[int]) -> List[float]:
        return [self.a * n + self.b * n * n for n in (int(x) for x in lengths)]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def check_fits(tokens: Sequence[int], cap: int, multiple: int, field: str, cp: int = 1) -> None:
    """ValueError naming the longest sequence, the cap and the fix when one sequence alone exceeds it."""
    longest = max(tokens, default=0)
    if _round_up(longest, multiple) > cap:
        per_rank = cap // cp
        raise ValueError(
            f"a sequence of {longest} tokens does not fit {field}={per_rank}"
            + (f" (x parallel.cp={cp} = {cap} tokens per micro-batch)" if cp > 1 else "")
            + (f" once rounded up to a multiple of {multiple}" if multiple > 1 and longest <= cap else "")
            + f"; raise {field} to at least {-(-_round_up(longest, multiple) // cp)}"
            + (" or use context parallelism (parallel.cp)" if cp == 1 else " or raise parallel.cp")
        )


def _greedy(order: List[int], tokens: Sequence[int], work: Sequence[float], cap: int, multiple: int,
            count: int) -> Optional[List[List[int]]]:
    """Longest work first, each to the least-loaded bin with room; None when some sequence finds none."""
    bins: List[List[int]] = [[] for _ in range(count)]
    load_t = [0] * count
    heap = [(0.0, k) for k in range(count)]  # (work, bin): least-loaded first, then lowest index
    for i in order:
        skipped = []
        while heap:
            w, k = heapq.heappop(heap)
            if _round_up(load_t[k] + tokens[i], multiple) <= cap:
                bins[k].append(i)
                load_t[k] += tokens[i]
                heapq.heappush(heap, (w + work[i], k))
                break
            skipped.append((w, k))
        else:
            return None
        for item in skipped:
            heapq.heappush(heap, item)
    return bins


def _by_work(tokens: Sequence[int], work: Sequence[float]) -> List[int]:
    return sorted(range(len(tokens)), key=lambda i: (-work[i], -tokens[i], i))


def pack(tokens: Sequence[int], work: Sequence[float], cap: int, *, multiple: int = 1,
         count: Optional[int] = None, field: str = "train.max_tokens_per_micro_batch",
         cp: int = 1) -> List[List[int]]:
    """Indices of ``tokens`` grouped into micro-batches of at most ``cap`` tokens (each stream rounded up
    to ``multiple``), work balanced; the fewest the greedy finds, or exactly ``count``. Within a
    micro-batch the indices are ascending."""
    n = len(tokens)
    if n == 0:
        raise ValueError("the batch is empty: nothing to train on (a data-parallel rank needs >= 1 sequence)")
    check_fits(tokens, cap, multiple, field, cp)
    order = _by_work(tokens, work)
    least = max(1, -(-sum(tokens) // cap))
    bins = None
    for m in range(least, n + 1):  # m = n always succeeds: one sequence per micro-batch
        bins = _greedy(order, tokens, work, cap, multiple, m)
        if bins is not None:
            break
    if count is not None and count != len(bins):
        if count < len(bins) or count > n:
            raise ValueError(f"cannot cut {n} sequences into exactly {count} micro-batches under {field}={cap // cp} "
                             f"(at least {len(bins)} needed, at most {n} possible)")
        forced = _greedy(order, tokens, work, cap, multiple, count)
        bins = forced if forced is not None and all(forced) else _split_to(bins, count, work)
    return [sorted(b) for b in bins]


def _split_to(bins: List[List[int]], count: int, work: Sequence[float]) -> List[List[int]]:
    """Split the bins with the most sequences (heaviest first) in two until there are ``count``; every
    part of a feasible bin is feasible."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        k = max(range(len(bins)), key=lambda i: (len(bins[i]), sum(work[j] for j in bins[i]), -i))
        items = sorted(bins[k], key=lambda i: (-work[i], i))
        bins[k:k + 1] = [items[0::2], items[1::2]]
    return bins


def assign_to_ranks(work: Sequence[float], dp: int) -> List[List[int]]:
    """Sequence indices for each of ``dp`` ranks: equal counts (the first ``B mod dp`` ranks one more),
    estimated work balanced (longest first to the least-loaded rank with room). Ascending within a rank."""
    n = len(work)
    room = [n // dp + (1 if r < n % dp else 0) for r in range(dp)]
    ranks: List[List[int]] = [[] for _ in range(dp)]
    heap = [(0.0, r) for r in range(dp)]
    for i in sorted(range(n), key=lambda i: (-work[i], i)):
        skipped = []
        while True:
            w, r = heapq.heappop(heap)
            if len(ranks[r]) < room[r]:
                break
            skipped.append((w, r))
        ranks[r].append(i)
        heapq.heappush(heap, (w + work[i], r))
        for item in skipped:
            heapq.heappush(heap, item)
    return [sorted(r) for r in ranks]


def imbalance(loads: Sequence[float]) -> float:
    """max / mean of per-rank loads (1 = perfectly balanced)."""
    loads = [float(x) for x in loads]
    mean = sum(loads) / max(len(loads), 1)
    return max(loads) / mean if mean > 0 else 1.0


def rank_rows(lengths: torch.Tensor, dp: int, work: Optional[Callable[[Sequence[int]], List[float]]] = None
              ) -> List[torch.Tensor]:
    """Rows of a step's batch for each data-parallel rank: balanced by ``work`` (:func:`assign_to_ranks`),
    or without it the contiguous equal split of ``TrainBatch.split``."""
    n = lengths.shape[0]
    if work is not None:
        return [torch.tensor(r, dtype=torch.long) for r in assign_to_ranks(work(lengths.tolist()), dp)]
    if n % dp:
        raise ValueError(f"cannot split a batch of {n} sequences into {dp} equal parts")
    return [torch.arange(r * (n // dp), (r + 1) * (n // dp)) for r in range(dp)]
