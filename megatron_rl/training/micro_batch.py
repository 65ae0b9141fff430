"""Micro-batches as the model sees them: padded ``[b, s]`` rows or one packed ``[1, T]`` stream, and
this context-parallel rank's share of either.

* **Padded**: every row right-padded to the micro-batch's longest sequence (rounded up to a multiple);
  causal attention leaves every real position unchanged, so no attention mask is needed.
* **Packed** (Megatron's THD format): the sequences back to back in one stream, their boundaries in
  ``cu_seqlens``; positions (RoPE) restart at every boundary and attention never crosses one
  (:mod:`megatron_rl.models.attention` on CPU, Transformer Engine through ``PackedSeqParams`` on GPU).
  The stream is padded only at its end, to a multiple (sequence parallelism needs ``T`` divisible by
  TP), as a segment of its own.
* **Context parallelism** (``cp_size > 1``): Megatron's zigzag load balancing. The padded sequence axis,
  or each packed sequence (first padded to a multiple of ``2·cp``, as TE's THD CP attention wants), is
  cut into ``2·cp`` chunks and rank ``r`` keeps chunks ``r`` and ``2·cp−1−r``. Targets and the response
  index are computed on the whole micro-batch first and then split, so each rank knows which response
  tokens its logits score; ``response_mask`` is restricted to them (the losses' CP reductions sum the
  ranks' disjoint token sets, :mod:`megatron_rl.objectives.reduce`).

Response-aligned fields stay ``[n, r]`` (``n`` sequences, ``r`` the longest response) whatever the
layout; ``logit_index[i, j]`` is the *flat* index, into this rank's ``b·s_local`` positions, of the
logits that predict response token ``j`` of sequence ``i``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Sequence

import torch

from megatron_rl.models.packed_attention import zigzag_stream_columns
from megatron_rl.objectives.records import BatchTokens, batch_tokens
from megatron_rl.objectives.reduce import zigzag_split

if TYPE_CHECKING:
    from megatron_rl.training.batch import TrainBatch

Tensor = torch.Tensor


@dataclass
class MicroBatch(BatchTokens):
    """One micro-batch on one rank.

    ``rows`` index the parent batch (``n`` sequences). ``input_ids``, ``position_ids``, ``targets``
    (next-token ids; 0 where nothing is predicted) and ``routed_experts`` are this rank's ``[b, s_local]``
    positions (packed: ``b = 1``). ``seq_length`` is the full length before the CP split (of a row, or
    of the stream). Packed micro-batches carry ``cu_seqlens`` (cumulative real lengths), ``cu_seqlens_padded``
    (segment boundaries in the stream) and ``max_seqlen`` (longest segment), in full-stream coordinates.
    ``real_tokens``: tokens that belong to a sequence (the rest is padding).
    """

    rows: Tensor
    input_ids: Tensor
    position_ids: Tensor
    targets: Tensor
    logit_index: Tensor
    response_mask: Tensor
    routed_experts: Optional[Tensor]
    route_checksums: Optional[Tensor] = None
    seq_length: int = 0
    real_tokens: int = 0
    cu_seqlens: Optional[Tensor] = None
    cu_seqlens_padded: Optional[Tensor] = None
    max_seqlen: int = 0

    @property
    def size(self) -> int:
        """Rows the model sees (1 when packed)."""
        return self.input_ids.shape[0]

    @property
    def num_sequences(self) -> int:
        return self.rows.shape[0]

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def token_slots(self) -> int:
        """Positions the model computes for this micro-batch over all CP ranks (real + padding)."""
        return self.size * self.seq_length


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def cp_multiple(cp_size: int) -> int:
    """What a zigzag-split length must be a multiple of."""
    return 2 * cp_size if cp_size > 1 else 1


def packed_lengths(lengths: Tensor, cp_size: int = 1) -> Tensor:
    """Tokens each sequence takes in a packed stream (padded to a multiple of ``2·cp`` under CP)."""
    m = cp_multiple(cp_size)
    return (lengths + m - 1) // m * m


def stream_multiple(pad_multiple: int, cp_size: int) -> int:
    return math.lcm(pad_multiple, cp_multiple(cp_size))


def num_micro_batches(batch_size: int, micro_batch_size: int) -> int:
    if batch_size < 1:
        raise ValueError("the batch is empty: nothing to train on (a data-parallel rank needs >= 1 sequence)")
    if micro_batch_size > batch_size:
        raise ValueError(f"train.micro_batch_size={micro_batch_size} is larger than this rank's batch of "
                         f"{batch_size} sequences; lower the micro-batch size or raise the batch size")
    if batch_size % micro_batch_size:
        raise ValueError(f"this rank's batch of {batch_size} sequences is not divisible by train.micro_batch_size="
                         f"{micro_batch_size}; make the per-rank batch a multiple of it")
    return batch_size // micro_batch_size


def fixed_size_groups(batch: "TrainBatch", micro_batch_size: int, group_by_length: bool = True) -> List[Tensor]:
    """Rows of ``B / micro_batch_size`` micro-batches (sorted by length first with ``group_by_length``;
    the sort is stable, so the grouping is deterministic)."""
    count = num_micro_batches(batch.batch_size, micro_batch_size)
    order = torch.argsort(batch.seq_lengths, stable=True) if group_by_length else torch.arange(batch.batch_size)
    return [order[k * micro_batch_size: (k + 1) * micro_batch_size] for k in range(count)]


def make_micro_batches(batch: "TrainBatch", micro_batch_size: int, *, pad_multiple: int = 1,
                       group_by_length: bool = True, same_length: bool = False, packed: bool = False,
                       cp_size: int = 1, cp_rank: int = 0) -> List[MicroBatch]:
    """Cut ``batch`` into ``B / micro_batch_size`` micro-batches (see :func:`build_micro_batches`)."""
    return build_micro_batches(batch, fixed_size_groups(batch, micro_batch_size, group_by_length),
                               pad_multiple=pad_multiple, same_length=same_length, packed=packed, cp_size=cp_size,
                               cp_rank=cp_rank)


def build_micro_batches(batch: "TrainBatch", groups: Sequence[Tensor], *, pad_multiple: int = 1,
                        same_length: bool = False, packed: bool = False, cp_size: int = 1,
                        cp_rank: int = 0) -> List[MicroBatch]:
    """One micro-batch per group of rows. Padded rows / packed streams are rounded up to ``pad_multiple``
    (and to ``2·cp``); ``same_length``: all to the longest (pipelines that cannot exchange shapes)."""
    multiple = stream_multiple(pad_multiple, cp_size)
    natural = [_natural_length(batch, rows, multiple, packed, cp_size) for rows in groups]
    fixed = max(natural) if same_length else None
    return [_micro_batch(batch, rows, fixed or n, packed, cp_size, cp_rank) for rows, n in zip(groups, natural)]


def _natural_length(batch: "TrainBatch", rows: Tensor, multiple: int, packed: bool, cp_size: int) -> int:
    lengths = batch.seq_lengths[rows]
    total = int(packed_lengths(lengths, cp_size).sum()) if packed else int(lengths.max())
    return _round_up(total, multiple)


def _micro_batch(batch: "TrainBatch", rows: Tensor, length: int, packed: bool, cp_size: int,
                 cp_rank: int) -> MicroBatch:
    rows = torch.as_tensor(rows, dtype=torch.long)
    plen, rlen = batch.prompt_lengths[rows], batch.response_lengths[rows]
    lens = plen + rlen
    n, r = len(rows), max(1, int(rlen.max()))
    # Every token of every sequence: (source row, column) -> (destination row, column) of the full layout.
    src_row = torch.repeat_interleave(rows, lens)
    src_col = torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    j = torch.arange(r)[None, :]
    if packed:
        seg = packed_lengths(lens, cp_size)
        starts = torch.cumsum(seg, 0) - seg
        trailing = length - int(seg.sum())
        segments = torch.cat([seg, torch.tensor([trailing])]) if trailing else seg
        b, dst_row, dst_col = 1, torch.zeros_like(src_row), torch.repeat_interleave(starts, lens) + src_col
        seg_starts = torch.cumsum(segments, 0) - segments
        positions = (torch.arange(length) - torch.repeat_interleave(seg_starts, segments))[None, :]
        # the logits predicting response token j sit at P - 1 + j (padding columns: the sequence's last token)
        flat = starts[:, None] + torch.minimum(plen[:, None] - 1 + j, lens[:, None] - 1)
        real = torch.cat([lens, torch.tensor([trailing])]) if trailing else lens
        cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(real, 0)]).to(torch.int32)
        cu_padded = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(segments, 0)]).to(torch.int32)
        packed_fields = dict(cu_seqlens=cu, cu_seqlens_padded=cu_padded, max_seqlen=int(segments.max()))
    else:
        b, dst_row, dst_col = n, torch.repeat_interleave(torch.arange(n), lens), src_col
        positions = torch.arange(length).expand(n, -1)
        flat = torch.arange(n)[:, None] * length + (plen[:, None] - 1 + j).clamp(max=length - 1)
        packed_fields = {}
    ids = torch.zeros(b, length, dtype=torch.long)  # padding id 0 (deterministic)
    ids[dst_row, dst_col] = batch.input_ids[src_row, src_col]
    targets = torch.zeros_like(ids)
    inner = src_col < torch.repeat_interleave(lens, lens) - 1  # tokens followed by one of their sequence
    targets[dst_row[inner], dst_col[inner]] = batch.input_ids[src_row[inner], src_col[inner] + 1]
    routed = None
    if batch.routed_experts is not None:
        src = batch.routed_experts
        routed = torch.empty((b, length) + tuple(src.shape[2:]), dtype=torch.long)
        routed[:] = torch.arange(src.shape[-1])  # padding positions: any valid, distinct expert ids
        routed[dst_row, dst_col] = src[src_row, src_col].long()
    mask = batch.response_mask[rows, :r]
    if cp_size > 1:  # keep this rank's zigzag columns; re-index the response tokens into them
        if packed:
            cols = zigzag_stream_columns(seg_starts, segments, cp_size, cp_rank)  # vectorised over segments
        else:
            cols = _zigzag(length, cp_size, cp_rank)
        to_local = torch.full((length,), -1, dtype=torch.long)
        to_local[cols] = torch.arange(len(cols))
        row, col = flat // length, flat % length
        local = to_local[col]
        mask = mask & (local >= 0)
        flat = torch.where(local >= 0, row * len(cols) + local, torch.zeros((), dtype=torch.long))
        ids, targets, positions = ids[:, cols], targets[:, cols], positions[:, cols]
        routed = None if routed is None else routed[:, cols]

    tokens = {name: None if v is None else v[rows, :r] for name, v in batch_tokens(batch).items()}
    return MicroBatch(
        rows=rows, input_ids=ids, position_ids=positions.contiguous(), targets=targets, logit_index=flat,
        response_mask=mask, routed_experts=routed,
        route_checksums=None if batch.route_checksums is None else batch.route_checksums[rows],
        seq_length=length, real_tokens=int(lens.sum()), **tokens, **packed_fields,
    )


def _zigzag(n: int, cp: int, rank: int) -> Tensor:
    return zigzag_split(torch.arange(n), cp, rank)
