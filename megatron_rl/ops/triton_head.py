"""Triton row kernels of the fused output layer's softmax statistics (the GPU path of
:mod:`megatron_rl.ops.linear`).

The logits block ``x [rows, n_valid]`` comes from a cuBLAS matmul (tensor cores; >95 % of the head's
FLOPs); these kernels replace the torch row passes over it, which read and write the block ~10 times
per chunk, by one program per row that streams the row in ``BLOCK``-wide tiles:

* ``forward_rows``: pass 1 the local row max ``m``; pass 2 ``S, Ez, E2`` relative to ``m`` and the raw
  target logit. Then (torch, per row) one all-reduce MAX gives the global ``M``, the sums are rescaled
  by ``exp(m - M)``, with min-p a third pass counts the kept mass ``S_K`` and ``e_y`` against the global
  ``M``, and one all-reduce SUM finishes: the same two collectives per chunk and the same per-row
  record as :func:`megatron_rl.ops.stats.forward_rows`.
* ``grad_rows``: one pass writing ``grad_z`` (in the block's dtype, in place over the block) from the
  per-row coefficients of :func:`megatron_rl.ops.stats.grad_coefficients`.

Statistics are fp32. The kept-set test ``exp(z - M) > thr`` is the same expression in the min-p
pass and in the gradient, so both see the same set. Verified on CPU under ``TRITON_INTERPRET=1``
(tests/unit/test_triton_head.py) against the torch path; ``tools/gpu_check.sh`` checks it on a GPU.
Triton is imported lazily (kernels are built on first use, so ``TRITON_INTERPRET`` set before that
first use takes effect).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.ops import _shard as sh
from megatron_rl.ops.stats import M, S

_BLOCK = 1024  # columns per tile (fp32 registers: 4 lanes per thread at 8 warps)


def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def stats_fwd(x_ptr, stride_x, n_cols, y_ptr, out_ptr, n_rows, temperature, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride_x
        y = tl.load(y_ptr + row)
        offs = tl.arange(0, BLOCK)
        m_vec = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            z = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32) / temperature
            m_vec = tl.maximum(m_vec, z)
        m = tl.max(m_vec, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)  # an all--inf row: keep -inf - -inf out
        s_vec = tl.zeros([BLOCK], tl.float32)
        ez_vec = tl.zeros([BLOCK], tl.float32)
        e2_vec = tl.zeros([BLOCK], tl.float32)
        zy_vec = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            z = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32) / temperature
            zs = z - m_safe
            e = tl.exp(zs)
            s_vec += e
            ez_vec += e * tl.where(e > 0, zs, 0.0)  # 0 * -inf terms of -inf logits vanish
            e2_vec += e * e
            zy_vec += tl.where(cols == y, z, 0.0)
        tl.store(out_ptr + row, m)
        tl.store(out_ptr + n_rows + row, tl.sum(s_vec, 0))
        tl.store(out_ptr + 2 * n_rows + row, tl.sum(ez_vec, 0))
        tl.store(out_ptr + 3 * n_rows + row, tl.sum(e2_vec, 0))
        tl.store(out_ptr + 4 * n_rows + row, tl.sum(zy_vec, 0))

    @triton.jit
    def kept_fwd(x_ptr, stride_x, n_cols, y_ptr, m_ptr, out_ptr, n_rows, temperature, thr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride_x
        y = tl.load(y_ptr + row)
        m = tl.load(m_ptr + row)
        offs = tl.arange(0, BLOCK)
        sk_vec = tl.zeros([BLOCK], tl.float32)
        ey_vec = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            z = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32) / temperature
            e = tl.exp(z - m)
            sk_vec += tl.where(e > thr, e, 0.0)
            ey_vec += tl.where(cols == y, e, 0.0)
        tl.store(out_ptr + row, tl.sum(sk_vec, 0))
        tl.store(out_ptr + n_rows + row, tl.sum(ey_vec, 0))

    @triton.jit
    def grad(x_ptr, stride_x, g_ptr, stride_g, n_cols, y_ptr, m_ptr, a_ptr, b_ptr, c_ptr, d_ptr, temperature, thr,
             HAS_BETA: tl.constexpr, HAS_GAMMA: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        xb = x_ptr + row * stride_x
        gb = g_ptr + row * stride_g
        y = tl.load(y_ptr + row)
        m = tl.load(m_ptr + row)
        alpha = tl.load(a_ptr + row)
        delta = tl.load(d_ptr + row)
        beta = 0.0
        gamma = 0.0
        if HAS_BETA:
            beta = tl.load(b_ptr + row)
        if HAS_GAMMA:
            gamma = tl.load(c_ptr + row)
        offs = tl.arange(0, BLOCK)
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            inside = cols < n_cols
            z = tl.load(xb + cols, mask=inside, other=float("-inf")).to(tl.float32) / temperature
            zs = z - m
            e = tl.exp(zs)
            u = e * alpha
            if HAS_BETA:
                u += e * (beta * tl.maximum(zs, -1e4))  # exp(-1e4) == 0: keeps 0 * -inf out
            if HAS_GAMMA:
                u -= gamma * tl.where(e > thr, e, 0.0)
            u += tl.where(cols == y, delta, 0.0)
            u = u / temperature
            tl.store(gb + cols, u.to(g_ptr.dtype.element_ty), mask=inside)

    return stats_fwd, kept_fwd, grad


def _rows_ready(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def forward_rows(x: torch.Tensor, y_col: torch.Tensor, shard: sh.Shard, temperature: float, thr: Optional[float],
                 out: torch.Tensor) -> bool:
    """As :func:`megatron_rl.ops.stats.forward_rows` for one block (``y_col``: the local target column,
    ``-1`` where another rank owns it). Returns False (``-inf`` logits need no special backward here)."""
    stats_fwd, kept_fwd, _ = _kernels()
    rows, nv = x.shape
    f = dict(dtype=torch.float32, device=x.device)
    part = torch.zeros(5, rows, **f)  # local m, S, Ez, E2 (relative to m), raw z_y
    if nv and rows:
        x = _rows_ready(x)
        stats_fwd[(rows,)](x, x.stride(0), nv, y_col, part, rows, float(temperature), BLOCK=_BLOCK, num_warps=8)
    else:
        part[0] = -torch.inf
    m_loc = part[0]
    m = shard.all_reduce(m_loc.clone(), dist.ReduceOp.MAX)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    r = torch.exp(m_loc - m)  # 0 where this rank's part of the row is all -inf
    shift = torch.where(part[1] > 0, (m_loc - m) * part[1], torch.zeros_like(m))
    owned = y_col >= 0
    sums = [r * part[1], r * (part[2] + shift), r * r * part[3], torch.where(owned, part[4] - m, torch.zeros_like(m))]
    if thr is not None:
        kept = torch.zeros(2, rows, **f)
        if nv and rows:
            kept_fwd[(rows,)](x, x.stride(0), nv, y_col, m, kept, rows, float(temperature), float(thr),
                              BLOCK=_BLOCK, num_warps=8)
        sums += [kept[0], torch.where(owned, kept[1], torch.zeros_like(m))]
    sums = shard.all_reduce(torch.stack(sums))
    out[M] = m
    out[S:S + len(sums)] = sums
    return False


def grad_rows(x: torch.Tensor, out: torch.Tensor, y_col: torch.Tensor, m: torch.Tensor, coef, temperature: float,
              thr: Optional[float]) -> None:
    """As :func:`megatron_rl.ops.stats.grad_rows` for one block; ``out`` may be ``x`` itself."""
    _, _, grad = _kernels()
    rows, nv = x.shape
    if not (nv and rows):
        return
    alpha, beta, gamma, delta = (None if c is None else c.float().contiguous() for c in coef)
    x = _rows_ready(x)
    assert out.stride(-1) == 1, "grad block must be row-contiguous"
    grad[(rows,)](x, x.stride(0), out, out.stride(0), nv, y_col, m.float().contiguous(), alpha,
                  alpha if beta is None else beta, alpha if gamma is None else gamma, delta, float(temperature),
                  float("inf") if thr is None else float(thr), HAS_BETA=beta is not None,
                  HAS_GAMMA=gamma is not None, BLOCK=_BLOCK, num_warps=8)
