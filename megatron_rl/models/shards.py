"""What each trainer rank owns of the HF weights: ``(Piece, tensor)`` pairs, no communication.

A :class:`Piece` names an HF tensor, its full shape and the box (``[start, stop)`` per dimension) this
rank's tensor fills. :func:`owned_pieces` yields them so that every element of every exported HF tensor
is produced by exactly one rank of the job: data-parallel (and context-parallel) replicas send nothing
(``dp`` rank 0 does; expert-data-parallel rank 0 for experts), a TP-replicated tensor (norms, router)
comes from TP rank 0, and a TP / expert-TP / EP shard is cut into the HF boxes it fills (a fused QKV shard
into its q, k and v rows, a gate|up shard into two row ranges, a row-parallel shard into a column range,
the padded vocabulary's tail dropped). The weight sync (``weights/sync.py``) sends each piece
straight from its owner to the engine side, which assembles: no all-gather, no rank that sees everything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import torch
from megatron.core import parallel_state as ps

from megatron_rl.models import mapping
from megatron_rl.models.mapping import QKVLayout, shard_range
from megatron_rl.models.weights import _local_param, _owner_stage

Box = Tuple[Tuple[int, int], ...]


@dataclass(frozen=True)
class Piece:
    name: str  # HF checkpoint name
    shape: Tuple[int, ...]  # the full HF tensor's shape
    box: Box  # per dimension, the [start, stop) this piece fills

    @property
    def piece_shape(self) -> Tuple[int, ...]:
        return tuple(b - a for a, b in self.box)

    @property
    def numel(self) -> int:
        return math.prod(self.piece_shape)

    @property
    def index(self) -> Tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in self.box)

    @property
    def whole(self) -> bool:
        return all(a == 0 and b == n for (a, b), n in zip(self.box, self.shape))


def _full(shape) -> Box:
    return tuple((0, n) for n in shape)


def _rows(shape, r0: int, r1: int) -> Box:
    return ((r0, r1),) + _full(shape[1:])


def _replica_ranks() -> Tuple[int, int]:
    """(data-parallel rank incl. context parallelism, expert-data-parallel rank); (0, 0) outside Megatron."""
    if not ps.model_parallel_is_initialized():
        return 0, 0
    return ps.get_data_parallel_rank(with_context_parallel=True), ps.get_expert_data_parallel_rank()


def _unit_pieces(built, unit: mapping.Unit, target) -> List[Tuple[Piece, torch.Tensor]]:
    arch, tp = built.arch, built.shard.tp
    hf = unit.hf
    if unit.kind == "replicated":
        return [(Piece(hf[0][0], hf[0][1], _full(hf[0][1])), target.detach())] if tp.rank == 0 else []
    if unit.kind == "experts":
        etp, out = built.shard.etp, []
        for e, fc1, fc2 in mapping.local_experts(target):
            (gate, gshape), (up, ushape), (down, dshape) = hf[3 * e: 3 * e + 3]
            r0, r1 = shard_range(gshape[0], etp.rank, etp.size, f"{gate} rows")
            g, u = fc1.detach().chunk(2, dim=0)
            out += [(Piece(gate, gshape, _rows(gshape, r0, r1)), g), (Piece(up, ushape, _rows(ushape, r0, r1)), u),
                    (Piece(down, dshape, ((0, dshape[0]), (r0, r1))), fc2.detach())]
        return out
    t = target.detach()
    if unit.kind == "vocab":
        (name, shape), = hf
        r0, r1 = shard_range(t.shape[0] * tp.size, tp.rank, tp.size, "padded vocabulary")
        r1 = min(r1, arch.vocab_size)
        return [(Piece(name, shape, _rows(shape, r0, r1)), t[: r1 - r0])] if r0 < r1 else []
    if unit.kind == "row":
        (name, shape), = hf
        c0, c1 = shard_range(shape[1], tp.rank, tp.size, f"{name} columns")
        return [(Piece(name, shape, ((0, shape[0]), (c0, c1))), t)]
    if unit.kind == "glu":
        (gate, gshape), (up, ushape) = hf
        r0, r1 = shard_range(gshape[0], tp.rank, tp.size, f"{gate} rows")
        g, u = t.chunk(2, dim=0)
        return [(Piece(gate, gshape, _rows(gshape, r0, r1)), g), (Piece(up, ushape, _rows(ushape, r0, r1)), u)]
    if unit.kind == "qkv":
        qkv = QKVLayout(arch.num_heads, arch.num_kv_heads, arch.head_dim)
        r0, r1, g0, g1 = qkv.rank_groups(tp.rank, tp.size)
        if r0 % qkv.group_rows or r1 % qkv.group_rows:
            raise NotImplementedError(f"TP={tp.size} splits a query group of {unit.hf[0][0]}: per-rank pieces "
                                      "need whole groups per rank (Megatron's num_query_groups % TP == 0)")
        hd, qpg, tail = qkv.head_dim, qkv.q_per_group, t.shape[1:]
        q, k, v = torch.split(t.reshape(g1 - g0, qkv.group_rows, *tail), [qpg * hd, hd, hd], dim=1)
        out = []
        for (name, shape), x, per in zip(hf, (q, k, v), (qpg * hd, hd, hd)):
            out.append((Piece(name, shape, _rows(shape, g0 * per, g1 * per)), x.reshape(-1, *tail)))
        return out
    raise AssertionError(unit.kind)


def owned_pieces(built) -> Iterator[Tuple[Piece, torch.Tensor]]:
    """This rank's pieces in the stable export order (units, then HF names). Tensors may be views of the
    parameters (a fused QKV shard's q/k/v rows are strided: ``.contiguous()`` before sending)."""
    dp, edp = _replica_ranks()
    layers = dict(built.layers())
    for unit in mapping.units(built.arch):
        if not unit.export or _owner_stage(built, unit) != built.shard.pp.rank:
            continue
        if (edp if unit.kind == "experts" else dp) != 0:
            continue
        target = _local_param(built, unit, layers)
        if target is None:
            continue
        yield from _unit_pieces(built, unit, target)


def assemble(pieces: List[Tuple[Piece, torch.Tensor]], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The full tensor from the pieces of one HF name (into ``out`` when given)."""
    first = pieces[0][0]
    if out is None:
        out = torch.empty(first.shape, dtype=pieces[0][1].dtype)
    for piece, t in pieces:
        out[piece.index].copy_(t)
    return out
