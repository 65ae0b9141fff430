"""The fused output layer: vocab-parallel statistics straight from the hidden states, never holding
the ``[T, V_local]`` logits.

``vocab_parallel_linear_stats(hidden, weight, targets)`` equals
``vocab_parallel_stats(hidden @ weight.T, targets)`` (same outputs, semantics and collectives), and
``vocab_parallel_linear_kl(hidden, weight, ref_hidden, ref_weight)`` equals
``vocab_parallel_kl(hidden @ weight.T, ref_hidden @ ref_weight.T)``. Forward processes rows in blocks:
each block's logits ``[block, n_valid]`` are computed by one matmul, reduced by the row passes of
:mod:`megatron_rl.ops.stats` / :mod:`megatron_rl.ops.kl` (chunked, two collectives per chunk), and
dropped. Backward needs only per-row scalars from forward, so it works on near-square tiles (rows x a
vocabulary slice, at most one block's elements): it recomputes each tile, turns it into the logit
gradient in place and feeds two matmuls (``dhidden[rows] += G W[slice]``, ``dW[slice] += G^T hidden[rows]``).
Peak extra memory: one block (plus the row passes' small chunk buffers, and fp32 accumulators for 16-bit
inputs: ``[V_local, H]`` for ``dW``, ``[tile rows, H]`` for ``dhidden``) instead of the logits and their
gradient; the cost is one extra ``hidden @ W^T`` in backward.

On CUDA (fp32 statistics) the row passes of ``vocab_parallel_linear_stats`` run as Triton kernels
(:mod:`megatron_rl.ops.triton_head`); elsewhere, and for the KL, the torch row passes.
Padding columns (``>= vocab_size``) are never computed: the matmul uses the real rows of ``weight``
only, and padding rows of ``weight`` get exactly zero gradient.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron_rl.ops import _shard as sh
from megatron_rl.ops import kl as klm
from megatron_rl.ops import stats as stm
from megatron_rl.ops import triton_head

# Logits elements per block (the only [rows, V]-sized allocation; backward tiles are no larger): 128 MiB
# fp32 on CPU (the row passes chunk it further to stay in cache; at V=152k, 220-row blocks cost ~10 %
# less forward time than 110-row ones, whose matmuls re-pack the whole weight every ~110 rows); on GPU
# 256M elements keep each matmul large.
_BLOCK_ELEMENTS_CPU = 1 << 25
_BLOCK_ELEMENTS_CUDA = 1 << 28
_BACKENDS = ("auto", "torch", "triton")
# Backward tile rows are this many elements apart: rows not on a 256-byte boundary made each tile's
# matmuls ~1.5x slower on CPU (MKL, measured).
_ALIGN = 64


def _block_rows(v_local: int, device: torch.device, chunk_size: Optional[int]) -> Tuple[int, int]:
    """(rows per logits block, rows per row-pass chunk); from ``V_local``, equal on every TP rank."""
    sub = sh.default_chunk_rows(v_local, device, None)
    if chunk_size is not None:
        block = sh.default_chunk_rows(v_local, device, chunk_size)
        return block, min(sub, block)
    budget = _BLOCK_ELEMENTS_CUDA if device.type == "cuda" else _BLOCK_ELEMENTS_CPU
    return max(sub, budget // v_local), sub


class _Blocks:
    """Logits blocks ``hidden[s:t] @ W_valid^T`` computed into one reused buffer."""

    def __init__(self, h: torch.Tensor, w: torch.Tensor, block: int) -> None:
        self.h, self.w = h, w
        self.block = max(1, min(block, h.shape[0]))
        self.buf = torch.empty(self.block, w.shape[0], dtype=h.dtype, device=h.device)

    def __iter__(self):
        for s, t in sh.row_chunks(self.h.shape[0], self.block):
            yield s, t, torch.mm(self.h[s:t], self.w.t(), out=self.buf[: t - s])


class _WeightGrad:
    """``dW`` accumulated tile by tile into its real rows (padding rows stay exactly zero); in fp32 for
    16-bit weights, so that many tiles lose nothing."""

    def __init__(self, weight: torch.Tensor, wanted: bool) -> None:
        self.weight = weight
        self.grad = None
        if wanted:
            self.grad = torch.zeros(weight.shape, dtype=_acc_dtype(weight.dtype), device=weight.device)

    def add(self, g_tile: torch.Tensor, h_rows: torch.Tensor, c0: int, c1: int) -> None:
        if self.grad is not None:
            _accumulate(self.grad[c0:c1], g_tile.t(), h_rows, first=False)

    def result(self) -> Optional[torch.Tensor]:
        return None if self.grad is None else self.grad.to(self.weight.dtype)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _accumulate(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``dst = a @ b`` (``first``) or ``dst += a @ b``; through a temporary when ``dst`` is an fp32
    accumulator of 16-bit products."""
    if dst.dtype == a.dtype:
        if first:
            torch.mm(a, b, out=dst)
        else:
            dst.addmm_(a, b)
        return
    prod = torch.mm(a, b)
    if first:
        dst.copy_(prod)
    else:
        dst.add_(prod)


def _even(n: int, most: int) -> int:
    """Piece size that splits ``n`` into ``ceil(n / most)`` near-equal pieces (none above ``most``)."""
    pieces = -(-n // max(1, most))
    return -(-n // max(1, pieces))


def _tile_shape(rows: int, nv: int, budget: int) -> Tuple[int, int]:
    """(rows, columns) of the backward's tiles: near-square, at most ``budget`` elements, the columns a
    multiple of ``_ALIGN`` where the budget allows (the tile buffer's row stride)."""
    r = _even(rows, max(1, math.isqrt(budget)))
    most = max(1, budget // r)
    if most < _ALIGN:
        return r, _even(nv, most)
    most -= most % _ALIGN
    c = _even(nv, most)
    return r, c + (-c % _ALIGN)


def _tile_buffers(tile: Tuple[int, int], sub_elements: int, dtype: torch.dtype, device, n: int = 3):
    """Row-pass buffers as wide as a tile, holding about ``sub_elements`` each (as in forward)."""
    return stm.RowBuffers(max(1, min(tile[0], sub_elements // tile[1])), tile[1], dtype, device, n)


def _tiled_grads(h: torch.Tensor, weight: torch.Tensor, nv: int, tile: Tuple[int, int], want_h: bool, want_w: bool,
                 tile_grad: Callable) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(dhidden, dW)`` for the logit gradient ``G`` of ``h @ W_valid^T``, never holding more than one tile of it.

    Tile by tile (rows ``r`` x vocabulary slice ``[c0, c1)``, ``tile`` from :func:`_tile_shape`): recompute
    the logits ``h[r] @ W[c0:c1]^T`` into one reused buffer, ``tile_grad(x, r, c0)`` overwrites them with
    their gradient, then ``dhidden[r] += G W[c0:c1]`` and ``dW[c0:c1] += G^T h[r]``. Near-square tiles keep
    the three matmuls large (inner sizes H, slice width, rows) and read each weight slice and ``dW`` slice
    once per row block (blocks of all columns and ~110 rows re-read the whole weight three times and ``dW``
    once per block: the fused head then took 1.5-1.7x the unfused time on CPU). ``dhidden`` of 16-bit
    inputs is summed in fp32 over the slices."""
    rows, width = h.shape
    grad_h = (torch.empty_like(h) if nv and rows else torch.zeros_like(h)) if want_h else None
    grad_w = _WeightGrad(weight, want_w)
    if not (nv and rows):
        return grad_h, grad_w.result()
    r_max, c_max = tile
    # A narrower last slice keeps the buffer's stride. Zeroed, not empty: torch 2.13's CPU bf16 matmul reads an
    # operand's row up to its stride (masked by zeros), so a NaN bit pattern left past the slice turns into NaN
    # gradients (~1 backward in 4 in tests/unit/test_ops_linear.py); later tiles only leave finite values there.
    buf = torch.zeros(r_max, c_max, dtype=h.dtype, device=h.device)
    acc_dtype = _acc_dtype(h.dtype)
    acc = torch.empty(r_max, width, dtype=acc_dtype, device=h.device) if want_h and acc_dtype != h.dtype else None
    w = weight[:nv]
    for r0, r1 in sh.row_chunks(rows, r_max):
        r, h_rows = slice(r0, r1), h[r0:r1]
        dh = None if not want_h else grad_h[r] if acc is None else acc[: r1 - r0]
        for c0, c1 in sh.row_chunks(nv, c_max):
            w_cols = w[c0:c1]
            x = torch.mm(h_rows, w_cols.t(), out=buf[: r1 - r0, : c1 - c0])
            tile_grad(x, r, c0)
            if dh is not None:
                _accumulate(dh, x, w_cols, first=c0 == 0)
            grad_w.add(x, h_rows, c0, c1)
        if acc is not None:
            grad_h[r].copy_(dh)
    return grad_h, grad_w.result()


def _use_triton(backend: str, x: torch.Tensor) -> bool:
    if backend == "triton":
        return True
    return backend == "auto" and x.is_cuda and x.dtype != torch.float64 and triton_head.available()


class _VocabParallelLinearStats(torch.autograd.Function):
    """:class:`megatron_rl.ops.stats._VocabParallelStats` over ``hidden @ weight.T``, block by block.

    Forward: per block of rows one matmul into a reused ``[block, n_valid]`` buffer, then the row passes
    (one all-reduce MAX + one all-reduce SUM per chunk, as the unfused op). Saved: references to
    ``hidden`` and ``weight`` (no copies), the targets and the per-row record (``M``, ``S``, ``H``, with
    min-p ``S_K'``, ``e_y``, y in K). Backward, without communication (:func:`_tiled_grads`): recompute each
    tile (rows x vocabulary slice, at most one block's elements), write its logit gradient over it (the
    target's term only in the slice holding it), then ``dhidden[rows] += G @ W[slice]`` and
    ``dW[slice] += G^T @ hidden[rows]``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, shard: sh.Shard, temperature: float, min_p, block: int, sub: int,
                use_triton: bool):
        nv = shard.n_valid
        h = hidden.reshape(-1, hidden.shape[-1])
        rows = h.shape[0]
        cd = sh.compute_dtype(hidden.dtype)
        y_loc, owned = sh.local_targets(targets.reshape(-1), shard)
        thr = stm.min_p_threshold(min_p, cd)
        rec = torch.zeros(7 if thr is not None else 5, rows, dtype=cd, device=hidden.device)
        has_neginf = False
        # A rank holding only padding (nv == 0) still runs every chunk's collectives, on [c, 0] blocks.
        blocks = _Blocks(h, weight[:nv], block)
        bufs = None if use_triton else stm.RowBuffers(min(sub, blocks.block), nv, cd, hidden.device)
        y_col = torch.where(owned, y_loc, -1)
        for s, t, x in blocks:
            if use_triton:
                triton_head.forward_rows(x, y_col[s:t], shard, temperature, thr, rec[:, s:t])
            else:
                has_neginf |= stm.forward_rows(x, y_loc[s:t], owned[s:t], shard, temperature, thr, bufs, rec[:, s:t])
        outs, saved = stm.finish_forward(rec, thr)
        ctx.shard, ctx.temperature, ctx.thr, ctx.has_neginf = shard, temperature, thr, has_neginf
        ctx.block, ctx.sub, ctx.use_triton = block, sub, use_triton
        ctx.mark_non_differentiable(*outs[2:3], *outs[4:])
        ctx.save_for_backward(hidden, weight, y_loc, owned, *saved)
        return tuple(o.view(targets.shape) for o in outs)

    @staticmethod
    def backward(ctx, g_lp, g_h, _g_spi2, g_pl=None, _g_km=None, _g_tk=None):
        hidden, weight, y_loc, owned, *saved = ctx.saved_tensors
        nones = (None,) * 7
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_lp is None and g_h is None and g_pl is None) or not (want_h or want_w):
            return (None, None) + nones
        nv = ctx.shard.n_valid
        h = hidden.reshape(-1, hidden.shape[-1])
        coef = stm.grad_coefficients(saved, owned, g_lp, g_h, g_pl, saved[0].dtype) if nv else None
        temperature, thr = ctx.temperature, ctx.thr
        tile = _tile_shape(h.shape[0], nv, ctx.block * nv)
        bufs = None
        if nv and not ctx.use_triton:
            bufs = _tile_buffers(tile, min(ctx.sub, ctx.block) * nv, saved[0].dtype, hidden.device)

        def tile_grad(x, r, c0):
            # The target's column lies in at most one slice: elsewhere its term (delta) is dropped.
            alpha, beta, gamma, delta = (None if v is None else v[r] for v in coef)
            inside = owned[r] & (y_loc[r] >= c0) & (y_loc[r] < c0 + x.shape[1])
            delta = torch.where(inside, delta, torch.zeros_like(delta))
            y = y_loc[r] - c0
            if ctx.use_triton:
                triton_head.grad_rows(x, x, torch.where(inside, y, -1), saved[0][r], (alpha, beta, gamma, delta),
                                      temperature, thr)
            else:
                stm.grad_rows(x, x, y.clamp(0, x.shape[1] - 1), saved[0][r], (alpha, beta, gamma, delta),
                              temperature, thr, ctx.has_neginf, bufs.narrow(x.shape[1]))

        grad_h, grad_w = _tiled_grads(h, weight, nv, tile, want_h, want_w, tile_grad)
        return (None if grad_h is None else grad_h.view_as(hidden), grad_w) + nones


class _VocabParallelLinearKL(torch.autograd.Function):
    """:class:`megatron_rl.ops.kl._VocabParallelKL` over ``hidden @ weight.T`` and
    ``ref_hidden @ ref_weight.T``, block by block (two matmuls per block forward; per backward tile two
    recomputes plus the two gradient matmuls); differentiable w.r.t. ``hidden`` and ``weight`` (the
    reference is detached). Collectives and saved per-row record as the unfused op."""

    @staticmethod
    def forward(ctx, hidden, weight, ref_hidden, ref_weight, shard: sh.Shard, direction: str, temperature: float,
                block: int, sub: int, with_tv: bool):
        nv = shard.n_valid
        h = hidden.reshape(-1, hidden.shape[-1])
        hr = ref_hidden.reshape(-1, ref_hidden.shape[-1])
        rows = h.shape[0]
        cd = sh.compute_dtype(hidden.dtype)
        rec = torch.zeros(klm.KL_ROWS, rows, dtype=cd, device=hidden.device)
        reverse = direction == "reverse"
        has_nonfinite = False
        blocks = _Blocks(h, weight[:nv], block)
        ref_blocks = _Blocks(hr, ref_weight[:nv], block)
        bufs = stm.RowBuffers(max(1, min(sub, blocks.block)), nv, cd, hidden.device, n=5)
        for (s, t, x), (_, _, xr) in zip(blocks, ref_blocks):
            has_nonfinite |= klm.kl_forward_rows(x, xr, shard, reverse, temperature, with_tv, bufs, rec[:, s:t])
        kl = klm.kl_value(rec, reverse)
        ctx.shard, ctx.temperature, ctx.reverse, ctx.has_nonfinite = shard, temperature, reverse, has_nonfinite
        ctx.block, ctx.sub = block, sub
        ctx.save_for_backward(hidden, weight, ref_hidden, ref_weight, rec, kl)
        shape = hidden.shape[:-1]
        if not with_tv:
            return kl.view(shape)
        tv = 0.5 * rec[klm.KTV]
        ctx.mark_non_differentiable(tv)
        return kl.view(shape), tv.view(shape)

    @staticmethod
    def backward(ctx, g_kl, _g_tv=None):
        hidden, weight, ref_hidden, ref_weight, rec, kl = ctx.saved_tensors
        nones = (None,) * 8
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if g_kl is None or not (want_h or want_w):
            return (None, None) + nones
        nv = ctx.shard.n_valid
        h = hidden.reshape(-1, hidden.shape[-1])
        hr = ref_hidden.reshape(-1, ref_hidden.shape[-1])
        g = g_kl.reshape(-1).to(rec.dtype)
        tile = _tile_shape(h.shape[0], nv, ctx.block * nv)
        ref_buf, bufs = None, None
        if nv:
            ref_buf = torch.empty(tile, dtype=hr.dtype, device=hr.device)
            bufs = _tile_buffers(tile, min(ctx.sub, ctx.block) * nv, rec.dtype, hidden.device, n=5)

        def tile_grad(x, r, c0):
            c1 = c0 + x.shape[1]
            xr = torch.mm(hr[r], ref_weight[c0:c1].t(), out=ref_buf[: x.shape[0], : x.shape[1]])
            klm.kl_grad_rows(x, xr, x, rec[:, r], kl[r], g[r], ctx.reverse, ctx.temperature, ctx.has_nonfinite,
                             bufs.narrow(x.shape[1]))

        grad_h, grad_w = _tiled_grads(h, weight, nv, tile, want_h, want_w, tile_grad)
        return (None if grad_h is None else grad_h.view_as(hidden), grad_w) + nones


def _check_linear(hidden: torch.Tensor, weight: torch.Tensor, names=("hidden", "weight")) -> None:
    hn, wn = names
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() < 1:
        raise ValueError(f"{hn}: expected a floating-point tensor [*, H]")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"{wn}: expected [V_local, H={hidden.shape[-1]}] (this rank's output-layer shard), got {got}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(f"{wn}: dtype/device {weight.dtype}/{weight.device} differ from {hn}'s "
                         f"{hidden.dtype}/{hidden.device}; cast one of them")


def _shard_of(hidden: torch.Tensor, weight: torch.Tensor, tp_group, vocab_size, name="weight") -> sh.Shard:
    # make_shard reads [*, V_local] off the last dim: a [V_local]-wide probe of the right dtype suffices.
    probe = torch.empty(0, weight.shape[0], dtype=hidden.dtype)
    return sh.make_shard(probe, tp_group, vocab_size, name)


def vocab_parallel_linear_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    min_p: Optional[float] = None,
    chunk_size: Optional[int] = None,
    backend: str = "auto",
) -> stm.VocabStats:
    """``vocab_parallel_stats(hidden @ weight.T, targets, ...)`` without materialising the logits.

    Args:
        hidden: ``[*, H]`` the output layer's input (gathered over sequence parallelism; identical on
            every TP rank; its gradient is this rank's vocabulary shard's part, to be summed over TP,
            as Megatron's ``ColumnParallelLinear`` input region does).
        weight: ``[V_local, H]`` this rank's output-layer shard (rows = its columns of the padded
            vocabulary), same dtype and device as ``hidden``.
        targets, tp_group, vocab_size, temperature, min_p: as :func:`megatron_rl.ops.vocab_parallel_stats`.
        chunk_size: rows per logits block (default ~32M elements on CPU, ~256M on GPU); backward tiles
            hold at most as many elements.
        backend: ``"auto"`` (Triton row kernels on CUDA, torch elsewhere), ``"torch"`` or ``"triton"``.
    Returns :class:`~megatron_rl.ops.VocabStats`; ``logprobs``, ``entropy``, ``pruned_logprobs`` are
    differentiable w.r.t. ``hidden`` and ``weight``.
    """
    _check_linear(hidden, weight)
    shard = _shard_of(hidden, weight, tp_group, vocab_size)
    if not isinstance(targets, torch.Tensor) or tuple(targets.shape) != tuple(hidden.shape[:-1]):
        got = tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__
        raise ValueError(f"targets: shape {got} must equal hidden.shape[:-1] = {tuple(hidden.shape[:-1])}")
    sh.check_targets(targets, hidden[..., :1], shard)
    temperature = sh.check_temperature(temperature)
    min_p = stm.check_min_p(min_p)
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")
    sh.check_group_consistency(shard, targets.numel(), targets)
    block, sub = _block_rows(shard.v_local, hidden.device, chunk_size)
    use_triton = _use_triton(backend, hidden)
    outs = _VocabParallelLinearStats.apply(hidden, weight, targets.long(), shard, temperature, min_p, block, sub,
                                           use_triton)
    return stm.VocabStats(*outs)


def vocab_parallel_linear_kl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ref_hidden: torch.Tensor,
    ref_weight: torch.Tensor,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    direction: str = "reverse",
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
    with_tv: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """``vocab_parallel_kl(hidden @ weight.T, ref_hidden @ ref_weight.T, ...)`` without materialising
    either policy's logits; differentiable w.r.t. ``hidden`` and ``weight``.

    ``ref_hidden [*, H_ref]`` and ``ref_weight [V_local, H_ref]`` are the reference model's output-layer
    input and shard (any hidden size; same vocabulary sharding), detached. Other arguments as
    :func:`megatron_rl.ops.vocab_parallel_kl`; ``chunk_size`` as :func:`vocab_parallel_linear_stats`.
    """
    klm.check_direction(direction)
    _check_linear(hidden, weight)
    _check_linear(ref_hidden, ref_weight, ("ref_hidden", "ref_weight"))
    shard = _shard_of(hidden, weight, tp_group, vocab_size)
    _shard_of(ref_hidden, ref_weight, tp_group, vocab_size, "ref_weight")
    if ref_weight.shape[0] != weight.shape[0] or ref_hidden.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(f"ref_hidden/ref_weight: shapes {tuple(ref_hidden.shape)}/{tuple(ref_weight.shape)} do not "
                         f"match hidden/weight {tuple(hidden.shape)}/{tuple(weight.shape)} (same tokens, same "
                         "vocabulary shard width)")
    if ref_hidden.dtype != hidden.dtype:
        raise ValueError(f"ref_hidden: dtype {ref_hidden.dtype} differs from hidden's {hidden.dtype}")
    temperature = sh.check_temperature(temperature)
    sh.check_group_consistency(shard, hidden.numel() // hidden.shape[-1], None)
    block, sub = _block_rows(shard.v_local, hidden.device, chunk_size)
    return _VocabParallelLinearKL.apply(hidden, weight, ref_hidden.detach(), ref_weight.detach(), shard, direction,
                                        temperature, block, sub, bool(with_tv))
