"""What every vocab-parallel op shares: shard geometry, input validation, chunking, row reductions.

Layout (math_spec §1.2): rank ``r`` of the tensor-parallel group holds columns
``[r * V_local, (r + 1) * V_local)`` of the padded vocabulary; columns ``>= vocab_size`` are padding.
Padding always sits at the end of the padded vocabulary, so on each rank the real columns are the
prefix ``[:n_valid]`` of the shard: ops slice it instead of masking, which costs nothing and makes
padding columns exactly absent from every reduction (their gradient is written as 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch
import torch.distributed as dist

# Elements per chunk buffer. On CPU ~16 MiB fp32 keeps the chunk's few passes in cache (measured:
# per-element cost doubles above ~64 MiB chunks); on GPU larger chunks amortise kernel launches.
_CHUNK_ELEMENTS_CPU = 1 << 22
_CHUNK_ELEMENTS_CUDA = 1 << 26


@dataclass(frozen=True)
class Shard:
    """Where this rank's columns sit in the padded vocabulary."""

    group: Optional[dist.ProcessGroup]
    world: int
    rank: int
    v_local: int
    vocab_size: int

    @property
    def offset(self) -> int:
        return self.rank * self.v_local

    @property
    def n_valid(self) -> int:
        """Number of real (non-padding) columns on this rank; a prefix of the shard."""
        return max(0, min(self.v_local, self.vocab_size - self.offset))

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t, op=op, group=self.group)
        return t


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics run in fp32 (fp64 when the caller asks for it, e.g. reference tests)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def make_shard(
    logits: torch.Tensor,
    tp_group: Optional[dist.ProcessGroup],
    vocab_size: Optional[int],
    name: str = "logits",
) -> Shard:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        got = logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"{name}: expected a floating-point tensor [*, V_local], got {got}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"{name}: expected shape [*, V_local] with V_local > 0, got {tuple(logits.shape)}")
    world = 1 if tp_group is None else dist.get_world_size(tp_group)
    rank = 0 if tp_group is None else dist.get_rank(tp_group)
    v_local = logits.shape[-1]
    padded = v_local * world
    if vocab_size is None:
        vocab_size = padded
    if not isinstance(vocab_size, int) or not 0 < vocab_size <= padded:
        raise ValueError(
            f"vocab_size={vocab_size} is inconsistent with {name} shards of width V_local={v_local} over "
            f"{world} tensor-parallel rank(s) (padded vocabulary {padded}); expected 0 < vocab_size <= {padded}"
        )
    return Shard(tp_group, world, rank, v_local, vocab_size)


def check_targets(targets: torch.Tensor, logits: torch.Tensor, shard: Shard) -> None:
    if not isinstance(targets, torch.Tensor) or targets.dtype not in (torch.int64, torch.int32):
        got = targets.dtype if isinstance(targets, torch.Tensor) else type(targets).__name__
        raise ValueError(f"targets: expected an int64 tensor of token ids, got {got}")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"targets: shape {tuple(targets.shape)} must equal logits.shape[:-1] = {tuple(logits.shape[:-1])}"
        )
    if targets.numel():
        lo, hi = int(targets.min()), int(targets.max())
        if lo < 0 or hi >= shard.vocab_size:
            raise ValueError(
                f"targets: ids must lie in [0, vocab_size={shard.vocab_size}), got min {lo}, max {hi}"
                " (mask padded positions with the loss mask instead of an ignore index)"
            )


def check_group_consistency(shard: Shard, rows: int, targets: Optional[torch.Tensor]) -> None:
    """One tiny MAX all-reduce that catches layouts the ranks disagree on, before any chunk loop
    (a row-count mismatch would otherwise hang in the first collective)."""
    if shard.world == 1:
        return
    tsum = int(targets.sum()) if targets is not None and targets.numel() else 0
    vals = [rows, shard.v_local, shard.vocab_size, tsum]
    t = torch.tensor(vals + [-v for v in vals], dtype=torch.int64)
    if dist.get_backend(shard.group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=shard.group)
    n = len(vals)
    hi, lo = t[:n].tolist(), [-v for v in t[n:].tolist()]
    names = ["number of rows (tokens)", "shard width V_local", "vocab_size", "targets (checksum)"]
    for name, a, b in zip(names, lo, hi):
        if a != b:
            raise ValueError(
                f"{name} differs across the {shard.world} tensor-parallel ranks (min {a}, max {b}); every rank "
                "must pass the same tokens, targets and vocab_size and equally wide logit shards"
            )


def check_temperature(temperature: float) -> float:
    t = float(temperature)
    if not math.isfinite(t) or t <= 0:
        raise ValueError(f"temperature: must be a finite number > 0, got {temperature}")
    return t


def default_chunk_rows(n_cols: int, device: torch.device, chunk_size: Optional[int]) -> int:
    if chunk_size is not None:
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size: must be a positive number of rows, got {chunk_size}")
        return int(chunk_size)
    budget = _CHUNK_ELEMENTS_CUDA if device.type == "cuda" else _CHUNK_ELEMENTS_CPU
    return max(1, budget // max(1, n_cols))


def row_chunks(rows: int, chunk: int) -> Iterator[Tuple[int, int]]:
    for start in range(0, rows, chunk):
        yield start, min(rows, start + chunk)


def load_chunk(x: torch.Tensor, buf: torch.Tensor, temperature: float) -> torch.Tensor:
    """``x / temperature`` in the compute dtype, without touching ``x``: a read-only view when no
    conversion is needed, else written into ``buf``."""
    if x.dtype == buf.dtype and temperature == 1.0:
        return x
    out = buf[: x.shape[0]]
    out.copy_(x)
    if temperature != 1.0:
        out.div_(temperature)
    return out


def shifted(zc: torch.Tensor, m: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """``zc - m[:, None]``: in place when ``zc`` already lives in ``buf`` (a converted copy),
    else written into ``buf`` so the caller's logits stay untouched."""
    if zc.data_ptr() == buf.data_ptr():
        return zc.sub_(m[:, None])
    return torch.sub(zc, m[:, None], out=buf[: zc.shape[0]])


def rowdot(a: torch.Tensor, b: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """Per-row dot product of two ``[c, n]`` tensors (``tmp`` is scratch of the same shape).

    A mul into reused scratch plus a row sum. (One BLAS dot per row reads less memory but measured
    ~9x slower per call on CPU once a gloo all-gather had run in the process: MKL state we don't
    control.)"""
    torch.mul(a, b, out=tmp)
    return tmp.sum(-1)


def masked_rowdot(e: torch.Tensor, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Row dot ``sum_v e_v x_v`` for ``rows`` treating ``e_v == 0`` terms as 0 even when ``x_v`` is
    ``-inf`` (the slow path used only for rows that contain ``-inf`` logits)."""
    er, xr = e[rows], x[rows]
    return torch.where(er > 0, er * xr, torch.zeros((), dtype=er.dtype)).sum(-1)


def local_targets(targets: torch.Tensor, shard: Shard) -> Tuple[torch.Tensor, torch.Tensor]:
    """(local column index clamped into range, bool: the target's column lives on this rank)."""
    local = targets - shard.offset
    owned = (local >= 0) & (local < shard.n_valid)
    return local.clamp(0, max(0, shard.n_valid - 1)), owned
