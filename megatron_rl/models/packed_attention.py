"""Packed (THD) attention in one call per layer, whatever the number of sequences.

Index work is built once per micro-batch (:class:`PackedPlan`, vectorised: no Python loop over sequences)
and reused by every layer. Three implementations, :func:`choose_impl` picks by device:

* ``varlen`` (CUDA, no CP, bf16/fp16, no dropout): ``torch.nn.attention.varlen.varlen_attn`` — flash
  attention over the stream with ``cu_seqlens``, causal, GQA; no gather at all.
* ``padded`` (CUDA under CP, in float32 or with dropout): the local rows gathered into ``[n, L_max/cp]`` queries and
  ``[n, L_max]`` keys with one index each, one causal SDPA (CP: a mask of each local row's global
  position), one index back. Padding rows point at row 0 (finite values); no real query attends to a
  padding key (causal within a segment), and padding queries are dropped, so their gradients are exact
  zeros. Cost ``n·L_max²`` scores instead of ``Σ L_i²``.
* ``per_length`` (the CPU default): one SDPA per distinct segment length, the segments of that length
  batched. Each segment is computed exactly as alone, so its result does not depend on its neighbours
  (bitwise; the padded path's reduction lengths follow ``L_max``), and no score is wasted on padding; on
  CPU, where a call costs no launch, that is what counts (README "Performance").
* ``block_diagonal`` (comparison only): one SDPA over the stream with a block-diagonal causal mask, ``O(T²)``.

tools/bench_launches.py counts the ops of both: ``padded`` (the GPU paths' one call per layer) dispatches
a fixed number per layer; ``per_length`` grows with the number of distinct lengths.
"""

from __future__ import annotations

from typing import Optional

import torch

IMPLS = ("auto", "padded", "varlen", "per_length", "block_diagonal")


def zigzag_rows(lengths: torch.Tensor, rows: torch.Tensor, cp: int, rank) -> torch.Tensor:
    """Global position inside its segment of local row ``rows`` of a segment of length ``lengths`` under
    Megatron's zigzag split (rank ``rank`` keeps chunks ``rank`` and ``2·cp−1−rank`` of ``2·cp``).
    Broadcasts: ``lengths [n, 1]`` with ``rows [1, r]`` gives ``[n, r]``; ``rank`` may be a tensor."""
    if cp == 1:
        return rows.expand(torch.broadcast_shapes(lengths.shape, rows.shape))
    chunk = lengths // (2 * cp)
    return torch.where(rows < chunk, rank * chunk + rows, (2 * cp - 1 - rank) * chunk + rows - chunk)


def zigzag_stream_columns(starts: torch.Tensor, lengths: torch.Tensor, cp: int, rank: int,
                          longest: Optional[int] = None) -> torch.Tensor:
    """Stream columns that CP rank ``rank`` holds of a stream of segments (``starts``, ``lengths``; each
    length a multiple of ``2·cp``), in local-stream order (segment by segment)."""
    longest = int(lengths.max()) if longest is None else longest
    rows = torch.arange(longest // cp, device=lengths.device)[None, :]
    local = lengths[:, None] // cp
    cols = starts[:, None] + zigzag_rows(lengths[:, None], rows, cp, rank)
    return cols[(rows < local).expand_as(cols)]


class PackedPlan:
    """Per-micro-batch index work of the packed path (computed at the first layer, reused by the rest).

    ``q_index [n, lq]`` / ``kv_index [n, L]``: rows of the local (query) and gathered-stream (key) tokens of
    each segment, padding rows pointing at row 0; ``q_valid`` marks real query rows; ``out_index``: for each
    local token, its row in the flattened ``[n·lq]`` output; ``mask`` (CP only) ``[n, 1, lq, L]``."""

    def __init__(self, cu_padded: torch.Tensor, cp: int, rank: int, longest: Optional[int], device) -> None:
        cu = cu_padded.to(device=device, dtype=torch.long)
        self.cu_padded, self.cp, self.rank = cu_padded, cp, rank
        starts, lengths = cu[:-1], cu[1:] - cu[:-1]
        self.starts, self.lengths = starts, lengths
        self.longest = int(lengths.max()) if longest is None else int(longest)
        n, lq = lengths.shape[0], self.longest // cp
        rows = torch.arange(lq, device=device)[None, :]
        cols = torch.arange(self.longest, device=device)[None, :]
        self.q_valid = rows < (lengths[:, None] // cp)
        self.q_index = torch.where(self.q_valid, starts[:, None] // cp + rows, 0)
        kv_index = torch.where(cols < lengths[:, None], starts[:, None] + cols, 0)
        self.out_index = (torch.arange(n, device=device)[:, None] * lq + rows)[self.q_valid]
        self.mask = None
        if cp > 1:
            pos_q = zigzag_rows(lengths[:, None], rows, cp, rank)  # [n, lq] global position in the segment
            self.mask = (cols[:, None, :] <= pos_q[:, :, None])[:, None]  # [n, 1, lq, L]
            # the all-gather yields the ranks' local streams in rank order: row of each stream position
            gathered = torch.cat([zigzag_stream_columns(starts, lengths, cp, r, self.longest) for r in range(cp)])
            to_stream = torch.argsort(gathered)
            kv_index = to_stream[kv_index]
            self.to_stream = to_stream
        self.kv_index = kv_index
        self._groups = None

    def length_groups(self):
        """``per_length``: per distinct segment length ``L`` (a loop over lengths, not sequences; CPU only),
        ``(q_index [m, L/cp], kv_index [m, L], mask or None)``, and the permutation back to stream order."""
        if self._groups is None:
            dev, cp = self.lengths.device, self.cp
            groups = []
            for length in torch.unique(self.lengths[self.lengths > 0]).tolist():
                segs = torch.nonzero(self.lengths == length).squeeze(1)
                start = self.starts[segs][:, None]
                rows = torch.arange(length // cp, device=dev)
                kv_index = start + torch.arange(length, device=dev)
                mask = None
                if cp > 1:
                    kv_index = self.to_stream[kv_index]
                    pos = zigzag_rows(torch.tensor([[length]], device=dev), rows[None], cp, self.rank)[0]
                    mask = torch.arange(length, device=dev)[None, :] <= pos[:, None]
                groups.append((start // cp + rows, kv_index, mask))
            inverse = torch.argsort(torch.cat([q.reshape(-1) for q, _, _ in groups]))
            self._groups = (groups, inverse)
        return self._groups

    def block_diagonal_mask(self) -> torch.Tensor:
        """``[t_local, T]`` boolean mask (True = attend) over the stream: same segment, not in the future."""
        dev = self.lengths.device
        seg_k = torch.repeat_interleave(torch.arange(self.lengths.shape[0], device=dev), self.lengths)
        pos_k = torch.arange(seg_k.shape[0], device=dev)
        pos_q = pos_k if self.cp == 1 else zigzag_stream_columns(self.starts, self.lengths, self.cp, self.rank,
                                                                 self.longest)
        return (seg_k[None, :] == seg_k[pos_q][:, None]) & (pos_k[None, :] <= pos_q[:, None])


def plan_for(params, cp: int, rank: int, device) -> PackedPlan:
    """The micro-batch's plan, cached on its ``PackedSeqParams`` (the same object reaches every layer)."""
    plan = getattr(params, "_megatron_rl_plan", None)
    if plan is None:
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        if cp > 1:
            lengths = cu[1:] - cu[:-1]
            if bool(((lengths % (2 * cp)) != 0).any()):
                raise ValueError(f"packed sequences under context parallelism must be padded to multiples of "
                                 f"2*cp={2 * cp}; got boundaries {cu.tolist()}")
        plan = PackedPlan(cu, cp, rank, params.max_seqlen_q or None, device)
        params._megatron_rl_plan = plan
    return plan


def choose_impl(requested: str, query: torch.Tensor, cp: int, dropout: float) -> str:
    if requested not in IMPLS:
        raise ValueError(f"attention.PACKED_IMPL={requested!r}: expected one of {IMPLS}")
    if requested != "auto":
        return requested
    if not query.is_cuda:
        return "per_length"
    if (query.is_cuda and cp == 1 and dropout == 0.0 and query.dtype in (torch.bfloat16, torch.float16)
            and _varlen() is not None):
        return "varlen"
    return "padded"


def _varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


def packed_attention(impl: str, q, k, v, plan: PackedPlan, scale: float, dropout: float, sdpa) -> torch.Tensor:
    """``q [t_local, heads, hn]``, ``k``/``v`` ``[T, groups, hn]`` (the whole stream, gathered under CP,
    rank order) -> ``[t_local, heads, hn]``. ``sdpa(q, k, v, mask, causal, dropout)`` takes ``[b, h, s, d]``."""
    t, heads, hn = q.shape
    if impl == "varlen":
        cu = plan.cu_padded.to(torch.int32)
        return _varlen()(q, k, v, cu, cu, plan.longest, plan.longest, scale=scale, window_size=(-1, 0),
                         enable_gqa=heads != k.shape[1])
    if impl == "block_diagonal":
        if plan.cp > 1:
            k, v = k[plan.to_stream], v[plan.to_stream]
        out = sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                   plan.block_diagonal_mask(), False, dropout)
        return out[0].transpose(0, 1)
    if impl == "per_length":
        groups, inverse = plan.length_groups()
        parts = [sdpa(q[qi].transpose(1, 2), k[ki].transpose(1, 2), v[ki].transpose(1, 2), mask, mask is None,
                      dropout).transpose(1, 2).reshape(-1, heads, hn) for qi, ki, mask in groups]
        return (parts[0] if len(parts) == 1 else torch.cat(parts))[inverse]
    # padded: [n, lq, heads, hn] -> [n, heads, lq, hn]
    qp = q[plan.q_index].transpose(1, 2)
    kp, vp = (x[plan.kv_index].transpose(1, 2) for x in (k, v))
    out = sdpa(qp, kp, vp, plan.mask, plan.mask is None, dropout)  # [n, heads, lq, hn]
    return out.transpose(1, 2).reshape(-1, heads, hn)[plan.out_index]
