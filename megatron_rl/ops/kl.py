"""Exact per-token KL (and optionally total variation) between two vocabulary-sharded policies.

For student logits ``z`` and reference logits ``r`` (same sharding, both divided by the temperature),
with row maxima ``M``, ``M_r``, ``e = exp(z - M)``, ``e_r = exp(r - M_r)``, ``S = sum e``,
``S_r = sum e_r`` and ``d = (z - M) - (r - M_r)`` (math_spec §c.3, §c.5):

    reverse  KL(pi || p) = sum e d / S   - log S + log S_r
    forward  KL(p || pi) = -sum e_r d / S_r + log S - log S_r
    TV                   = 1/2 sum |e / S - e_r / S_r|

Closed-form logit gradients (reference detached): reverse ``pi * (log pi - log p - KL)``,
forward ``pi - p``. Both sum to zero over the vocabulary.

The row passes (:func:`kl_forward_rows`, :func:`kl_grad_rows`) work on any pair of ``[rows, n_valid]``
logit blocks; the fused output layer (:mod:`megatron_rl.ops.linear`) feeds them blocks it computes.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron_rl.ops import _shard as sh
from megatron_rl.ops.stats import RowBuffers

_DIRECTIONS = ("reverse", "forward")
# Rows of the per-row record (a [KL_ROWS, rows] tensor): maxima, normalisers, the KL dot, TV.
KM, KMR, KS, KSR, KDOT, KTV = range(6)
KL_ROWS = 6


def kl_forward_rows(x: torch.Tensor, xr: torch.Tensor, shard: sh.Shard, reverse: bool, temperature: float,
                    with_tv: bool, bufs: RowBuffers, out: torch.Tensor) -> bool:
    """Per-row ``M, M_r, S, S_r, dot(, TV)`` of the blocks ``x``, ``xr`` ``[rows, n_valid]`` into
    ``out [KL_ROWS, rows]``; returns whether non-finite logits needed the slow masked dot."""
    rows, nv = out.shape[1], shard.n_valid
    f = dict(dtype=out.dtype, device=out.device)
    zbuf, rbuf, ebuf, erbuf, tmp = bufs.bufs
    has_nonfinite = False
    for s, t in sh.row_chunks(rows, bufs.chunk):
        c = t - s
        m = torch.full((2, c), -torch.inf, **f)
        if nv:
            zc = sh.load_chunk(x[s:t], zbuf, temperature)
            rc = sh.load_chunk(xr[s:t], rbuf, temperature)
            m[0], m[1] = zc.amax(-1), rc.amax(-1)
        shard.all_reduce(m, dist.ReduceOp.MAX)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        sums = torch.zeros(3, c, **f)
        if nv:
            zs, rs = sh.shifted(zc, m[0], zbuf), sh.shifted(rc, m[1], rbuf)
            e = torch.exp(zs, out=ebuf[:c])
            er = torch.exp(rs, out=erbuf[:c])
            sums[0], sums[1] = e.sum(-1), er.sum(-1)
            d = zs.sub_(rs)
            w = e if reverse else er
            sums[2] = sh.rowdot(w, d, tmp[:c])
            bad = torch.isnan(sums[2]) & ~torch.isnan(sums[0] + sums[1])
            if bool(bad.any()):  # -inf logits: 0 * inf terms; NaN inputs still propagate
                has_nonfinite = True
                sums[2, bad] = sh.masked_rowdot(w, d, bad)
        shard.all_reduce(sums)
        out[KM:KMR + 1, s:t] = m
        out[KS:KDOT + 1, s:t] = sums
        if with_tv:
            part = torch.zeros(c, **f)
            if nv:
                e.div_(sums[0, :, None])
                part = e.sub_(er.div_(sums[1, :, None])).abs_().sum(-1)
            out[KTV, s:t] = shard.all_reduce(part)
    return has_nonfinite


def kl_value(rec: torch.Tensor, reverse: bool) -> torch.Tensor:
    log_ratio = rec[KSR].log() - rec[KS].log()  # log S_r - log S
    return rec[KDOT] / rec[KS] + log_ratio if reverse else -rec[KDOT] / rec[KSR] - log_ratio


def kl_grad_rows(x: torch.Tensor, xr: torch.Tensor, out: torch.Tensor, rec: torch.Tensor, kl: torch.Tensor,
                 g: torch.Tensor, reverse: bool, temperature: float, has_nonfinite: bool, bufs: RowBuffers) -> None:
    """Write the student-logit gradient of the blocks into ``out [rows, n_valid]`` (it may be ``x``)."""
    f = dict(dtype=rec.dtype, device=rec.device)
    g_s, g_sr = g / rec[KS], g / rec[KSR]
    # reverse: grad = e * (d + log S_r - log S - KL) * g / S
    shift = rec[KSR].log() - rec[KS].log() - kl
    zbuf, rbuf, ebuf, ubuf, _ = bufs.bufs
    direct = out.dtype == zbuf.dtype
    for s, t in sh.row_chunks(x.shape[0], bufs.chunk):
        c = t - s
        zs = sh.shifted(sh.load_chunk(x[s:t], zbuf, temperature), rec[KM, s:t], zbuf)
        rs = sh.shifted(sh.load_chunk(xr[s:t], rbuf, temperature), rec[KMR, s:t], rbuf)
        e = torch.exp(zs, out=ebuf[:c])
        u = out[s:t] if direct else ubuf[:c]
        if reverse:
            d = zs.sub_(rs).add_(shift[s:t, None]).mul_(g_s[s:t, None])
            if has_nonfinite:
                d = torch.where(e > 0, d, torch.zeros((), **f))
            torch.mul(d, e, out=u)
        else:
            torch.mul(e, g_s[s:t, None], out=u)
            u.sub_(rs.exp_().mul_(g_sr[s:t, None]))
        if temperature != 1.0:
            u.div_(temperature)
        if not direct:
            out[s:t].copy_(u)


class _VocabParallelKL(torch.autograd.Function):
    """Fused vocab-parallel exact KL, differentiable w.r.t. the student logits only.

    Collectives (tensor-parallel group, per chunk of rows): one all-reduce MAX of the stacked row
    maxima ``[2, c]`` and one all-reduce SUM of the stacked row sums ``[3, c]`` (S, S_r, the KL dot);
    with TV one more all-reduce SUM ``[c]`` (TV needs the global normalisers first).
    Backward: no communication; it recomputes each chunk from the saved references to both logit
    tensors (no copies) and the per-row ``M``, ``M_r``, ``S``, ``S_r``, ``KL``.
    """

    @staticmethod
    def forward(ctx, logits, ref_logits, shard: sh.Shard, direction: str, temperature: float, chunk: int,
                with_tv: bool):
        nv = shard.n_valid
        x = logits.reshape(-1, shard.v_local)[:, :nv]
        xr = ref_logits.reshape(-1, shard.v_local)[:, :nv]
        rows = x.shape[0]
        cd = sh.compute_dtype(logits.dtype)
        rec = torch.zeros(KL_ROWS, rows, dtype=cd, device=logits.device)
        bufs = RowBuffers(max(1, min(chunk, rows)), nv, cd, logits.device, n=5)
        reverse = direction == "reverse"
        ctx.has_nonfinite = kl_forward_rows(x, xr, shard, reverse, temperature, with_tv, bufs, rec)
        kl = kl_value(rec, reverse)
        ctx.shard, ctx.temperature, ctx.chunk, ctx.reverse = shard, temperature, bufs.chunk, reverse
        ctx.save_for_backward(logits, ref_logits, rec, kl)
        shape = logits.shape[:-1]
        if not with_tv:
            return kl.view(shape)
        tv = 0.5 * rec[KTV]
        ctx.mark_non_differentiable(tv)
        return kl.view(shape), tv.view(shape)

    @staticmethod
    def backward(ctx, g_kl, _g_tv=None):
        logits, ref_logits, rec, kl = ctx.saved_tensors
        none = (None,) * 6
        if g_kl is None:
            return (None,) + none
        shard = ctx.shard
        v_local, nv = shard.v_local, shard.n_valid
        grad = torch.empty(logits.numel() // v_local, v_local, dtype=logits.dtype, device=logits.device)
        if nv < v_local:
            grad[:, nv:] = 0
        if nv:
            bufs = RowBuffers(ctx.chunk, nv, rec.dtype, logits.device, n=5)
            kl_grad_rows(logits.reshape(-1, v_local)[:, :nv], ref_logits.reshape(-1, v_local)[:, :nv], grad[:, :nv],
                         rec, kl, g_kl.reshape(-1).to(rec.dtype), ctx.reverse, ctx.temperature, ctx.has_nonfinite,
                         bufs)
        return (grad.view_as(logits),) + none


def check_direction(direction: str) -> None:
    if direction not in _DIRECTIONS:
        raise ValueError(f"direction: expected one of {_DIRECTIONS}, got {direction!r}")


def vocab_parallel_kl(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    direction: str = "reverse",
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
    with_tv: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact per-token KL over the full (sharded) vocabulary; differentiable w.r.t. ``logits`` only.

    Args:
        logits: student/current-policy logits ``[*, V_local]`` (never modified).
        ref_logits: reference/teacher logits, sharded identically (detached; never modified).
        direction: ``"reverse"`` = KL(pi_theta || pi_ref), ``"forward"`` = KL(pi_ref || pi_theta).
        with_tv: also return the exact per-token total variation (one extra all-reduce per chunk).
    Returns ``kl [*]`` in fp32, or ``(kl, tv)`` with ``with_tv``. A reference with ``-inf`` where the
    student has mass gives an infinite reverse KL (exact; the trainer then skips the step).
    """
    check_direction(direction)
    shard = sh.make_shard(logits, tp_group, vocab_size, "logits")
    sh.make_shard(ref_logits, tp_group, vocab_size, "ref_logits")
    if ref_logits.shape != logits.shape:
        raise ValueError(
            f"ref_logits: shape {tuple(ref_logits.shape)} must equal logits shape {tuple(logits.shape)}"
            " (the reference must be sharded over the vocabulary exactly like the student)"
        )
    temperature = sh.check_temperature(temperature)
    sh.check_group_consistency(shard, logits.numel() // shard.v_local, None)
    chunk = sh.default_chunk_rows(shard.v_local, logits.device, chunk_size)  # equal on every rank
    return _VocabParallelKL.apply(logits, ref_logits.detach(), shard, direction, temperature, chunk, bool(with_tv))
