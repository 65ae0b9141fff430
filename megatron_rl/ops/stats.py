"""Per-token log-prob, entropy, sum pi^2 and DVP-pruned log-prob over vocabulary-sharded logits.

One fused, chunked pass (math_spec §1.2 P1-P6, §b.2, §d.3). For each chunk of rows with
``z = logits / temperature`` (padding columns excluded) and the global row max ``M``:

    e_v = exp(z_v - M)        S = sum e        Ez = sum e (z - M)      E2 = sum e^2
    log pi(y)      = (z_y - M) - log S
    H              = log S - Ez / S
    sum_v pi_v^2   = E2 / S^2
    DVP (min-p)    K = {v : e_v >= min_p}  (pi_v >= min_p * max pi, SGLang's min-p rule)
                   S_K = sum_{v in K} e_v,   Z_K = S_K / S
                   log pi_K(y) = (z_y - M) - log(S_K + [y not in K] e_y)   (target force-included)

The row passes (:func:`forward_rows`, :func:`grad_rows`) work on any ``[rows, n_valid]`` block of
logits, so the fused output layer (:mod:`megatron_rl.ops.linear`) runs them on blocks it computes
from the hidden states instead of on stored logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.ops import _shard as sh

# Rows of the per-row record kept between forward and backward (a [N_ROWS, rows] tensor).
M, S, EZ, E2, ZY, SK, EY = range(7)


@dataclass
class VocabStats:
    """Per-token statistics, each shaped like ``targets``, in fp32 (fp64 for fp64 logits).

    logprobs:        log pi(y_t | c_t), differentiable.
    entropy:         H(pi(. | c_t)), differentiable.
    sum_pi_squared:  sum_v pi(v | c_t)^2 (input of the OTB logit-gradient proxy), no grad.
    pruned_logprobs: log pi_K(y_t) over the min-p kept set K, with y_t force-included in the
                     normaliser when it falls outside K; differentiable, pruned columns get exactly
                     zero gradient. ``None`` without ``min_p``.
    kept_mass:       Z_K = sum_{v in K} pi_v of the rule's set K (DVP bias is 1 - Z_K), no grad.
    target_kept:     bool, y_t in K (False means the sampled token was pruned by the trainer's rule).
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    sum_pi_squared: torch.Tensor
    pruned_logprobs: Optional[torch.Tensor] = None
    kept_mass: Optional[torch.Tensor] = None
    target_kept: Optional[torch.Tensor] = None


def min_p_threshold(min_p: Optional[float], cd: torch.dtype) -> Optional[float]:
    """``e >= min_p  <=>  e > thr``, the comparison made in the compute dtype on both passes."""
    if min_p is None:
        return None
    np_t = np.float64 if cd == torch.float64 else np.float32
    return float(np.nextafter(np_t(min_p), np_t(0)))


class RowBuffers:
    """Scratch ``[chunk, n_valid]`` buffers of the row passes, allocated once per op call."""

    def __init__(self, chunk: int, nv: int, dtype: torch.dtype, device, n: int = 3) -> None:
        self.chunk = chunk
        self.bufs = [torch.empty(chunk, nv, dtype=dtype, device=device) for _ in range(n)]

    def narrow(self, width: int) -> "RowBuffers":
        """The same buffers restricted to their first ``width`` columns (for a narrower block)."""
        out = RowBuffers.__new__(RowBuffers)
        out.chunk, out.bufs = self.chunk, [b[:, :width] for b in self.bufs]
        return out


def forward_rows(x: torch.Tensor, y_loc: torch.Tensor, owned: torch.Tensor, shard: sh.Shard, temperature: float,
                 thr: Optional[float], bufs: RowBuffers, out: torch.Tensor) -> bool:
    """Per-row statistics of the logits block ``x [rows, n_valid]`` (this rank's real columns), chunk by
    chunk with one all-reduce MAX and one all-reduce SUM per chunk; writes ``out [M..ZY(, SK, EY), rows]``
    and returns whether a ``-inf`` logit met a ``0 * -inf`` term (the backward then takes care)."""
    rows, nv = out.shape[1], shard.n_valid
    f = dict(dtype=out.dtype, device=out.device)
    dvp = thr is not None
    n_sums = 6 if dvp else 4
    zbuf, ebuf, tmp = bufs.bufs
    has_neginf = False
    for s, t in sh.row_chunks(rows, bufs.chunk):
        c = t - s
        if nv:
            zc = sh.load_chunk(x[s:t], zbuf, temperature)
            m = zc.amax(-1)
        else:
            m = torch.full((c,), -torch.inf, **f)
        shard.all_reduce(m, dist.ReduceOp.MAX)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all--inf rows: avoid -inf - -inf
        sums = torch.zeros(n_sums, c, **f)  # S, Ez, E2, zy(, SK, ey)
        if nv:
            zs = sh.shifted(zc, m, zbuf)
            e = torch.exp(zs, out=ebuf[:c])
            sums[0] = e.sum(-1)
            sums[1] = sh.rowdot(e, zs, tmp[:c])
            bad = torch.isnan(sums[1]) & ~torch.isnan(sums[0])
            if bool(bad.any()):  # -inf logits: 0 * -inf terms; NaN inputs still propagate
                has_neginf = True
                sums[1, bad] = sh.masked_rowdot(e, zs, bad)
            sums[2] = torch.linalg.vector_norm(e, dim=-1).square()
            zy = zs.gather(1, y_loc[s:t, None]).squeeze(1)
            sums[3] = torch.where(owned[s:t], zy, torch.zeros_like(zy))
            if dvp:
                ey = e.gather(1, y_loc[s:t, None]).squeeze(1)  # from e itself: same rounding as the mask
                sums[5] = torch.where(owned[s:t], ey, torch.zeros_like(ey))
                kept = torch.threshold(e, thr, 0.0, out=zbuf[:c])  # zs no longer needed
                sums[4] = kept.sum(-1)
        shard.all_reduce(sums)
        out[M, s:t] = m
        out[S:S + n_sums, s:t] = sums
    return has_neginf


def finish_forward(rec: torch.Tensor, thr: Optional[float]):
    """``(logprobs, entropy, sum_pi_sq[, pruned, kept_mass, target_kept], saved)`` from the per-row record;
    ``saved`` are the per-row tensors :func:`grad_coefficients` needs."""
    s, zy = rec[S], rec[ZY]
    log_s = s.log()
    logprobs = zy - log_s
    entropy = log_s - rec[EZ] / s
    sum_pi_sq = rec[E2] / (s * s)
    if thr is None:
        return (logprobs, entropy, sum_pi_sq), (rec[M], s, entropy)
    e_y = rec[EY]
    target_kept = e_y > thr
    sk_full = rec[SK] + torch.where(target_kept, torch.zeros_like(e_y), e_y)
    pruned = zy - sk_full.log()
    kept_mass = rec[SK] / s
    outs = (logprobs, entropy, sum_pi_sq, pruned, kept_mass, target_kept)
    return outs, (rec[M], s, entropy, sk_full, target_kept, e_y)


def grad_coefficients(saved, owned, g_lp, g_h, g_pl, cd):
    """Per-row ``(alpha, beta, gamma, delta)`` of the logit gradient (``None`` where a term is absent):

        grad_z = e * (alpha + beta * (z - M)) - gamma * e * [v in K] + onehot_y * delta

    from d log pi(y) = 1[v=y] - pi,  dH = -pi (log pi + H),  d log pi_K(y) = 1[v=y] - pi_K [v in K']."""
    Mx, s, H, *dvp_saved = saved
    zero = torch.zeros_like(s)
    g_lp = zero if g_lp is None else g_lp.reshape(-1).to(cd)
    inv_s = 1.0 / s
    alpha = -g_lp * inv_s
    beta = None
    if g_h is not None:
        g_h = g_h.reshape(-1).to(cd)
        alpha = alpha + g_h * (s.log() - H) * inv_s
        beta = -g_h * inv_s
    delta = g_lp
    gamma = None
    if dvp_saved and g_pl is not None:
        sk_full, target_kept, e_y = dvp_saved
        g_pl = g_pl.reshape(-1).to(cd)
        gamma = g_pl / sk_full
        # A force-included target is in K' but not in the threshold mask: its -gamma * e_y here.
        delta = delta + g_pl - torch.where(target_kept, zero, gamma * e_y)
    delta = torch.where(owned, delta, zero)
    return alpha, beta, gamma, delta


def grad_rows(x: torch.Tensor, out: torch.Tensor, y_loc: torch.Tensor, Mx: torch.Tensor, coef, temperature: float,
              thr: Optional[float], has_neginf: bool, bufs: RowBuffers) -> None:
    """Write the logit gradient of the block ``x [rows, n_valid]`` into ``out`` (same shape; it may be
    ``x`` itself: each chunk is read before it is written). ``coef`` from :func:`grad_coefficients`."""
    alpha, beta, gamma, delta = coef
    rows = x.shape[0]
    zbuf, ebuf, ubuf = bufs.bufs
    direct = out.dtype == zbuf.dtype
    for s, t in sh.row_chunks(rows, bufs.chunk):
        c = t - s
        zc = sh.load_chunk(x[s:t], zbuf, temperature)
        zs = sh.shifted(zc, Mx[s:t], zbuf)
        e = torch.exp(zs, out=ebuf[:c])
        u = out[s:t] if direct else ubuf[:c]
        if beta is not None:
            if has_neginf:
                zs.clamp_(min=-1e4)  # exp(-1e4) == 0 already; keeps 0 * -inf out of the product
            zs.mul_(beta[s:t, None]).add_(alpha[s:t, None])
            torch.mul(zs, e, out=u)
        else:
            torch.mul(e, alpha[s:t, None], out=u)
        if gamma is not None:
            kept = torch.threshold(e, thr, 0.0, out=zbuf[:c])
            u.sub_(kept.mul_(gamma[s:t, None]))
        u.scatter_add_(1, y_loc[s:t, None], delta[s:t, None])
        if temperature != 1.0:
            u.div_(temperature)
        if not direct:
            out[s:t].copy_(u)


class _VocabParallelStats(torch.autograd.Function):
    """Fused vocab-parallel log-prob / entropy / sum pi^2 / min-p pruned log-prob.

    Collectives (tensor-parallel group, per chunk of rows): one all-reduce MAX of the row maxima
    ``[c]`` and one all-reduce SUM of the stacked row sums ``[4 or 6, c]`` (S, Ez, E2, z_y - M, and
    with min-p S_K, e_y).
    Backward: no communication. It recomputes ``e`` chunk by chunk from the logits and the saved
    per-row scalars; saved are a reference to the caller's logits (no copy), the targets, and the
    per-row ``M``, ``S``, ``H`` (and ``S_K'``, ``e_y``, y in K with min-p). Peak extra memory is a few
    ``[chunk, V_local]`` buffers plus the ``[T, V_local]`` gradient itself, independent of T.
    """

    @staticmethod
    def forward(ctx, logits, targets, shard: sh.Shard, temperature: float, min_p, chunk: int):
        nv = shard.n_valid
        x = logits.reshape(-1, shard.v_local)[:, :nv]
        rows = x.shape[0]
        cd = sh.compute_dtype(logits.dtype)
        y_loc, owned = sh.local_targets(targets.reshape(-1), shard)
        thr = min_p_threshold(min_p, cd)
        bufs = RowBuffers(max(1, min(chunk, rows)), nv, cd, logits.device)
        rec = torch.empty(7 if thr is not None else 5, rows, dtype=cd, device=logits.device)
        ctx.has_neginf = forward_rows(x, y_loc, owned, shard, temperature, thr, bufs, rec)
        outs, saved = finish_forward(rec, thr)
        ctx.shard, ctx.temperature, ctx.chunk, ctx.thr = shard, temperature, bufs.chunk, thr
        ctx.mark_non_differentiable(*outs[2:3], *outs[4:])
        ctx.save_for_backward(logits, y_loc, owned, *saved)
        return tuple(o.view(targets.shape) for o in outs)

    @staticmethod
    def backward(ctx, g_lp, g_h, _g_spi2, g_pl=None, _g_km=None, _g_tk=None):
        logits, y_loc, owned, *saved = ctx.saved_tensors
        if g_lp is None and g_h is None and g_pl is None:
            return (None,) * 6
        shard = ctx.shard
        nv = shard.n_valid
        grad = torch.empty(logits.numel() // shard.v_local, shard.v_local, dtype=logits.dtype, device=logits.device)
        if nv < shard.v_local:
            grad[:, nv:] = 0
        if nv:
            cd = saved[0].dtype
            coef = grad_coefficients(saved, owned, g_lp, g_h, g_pl, cd)
            bufs = RowBuffers(ctx.chunk, nv, cd, logits.device)
            grad_rows(logits.reshape(-1, shard.v_local)[:, :nv], grad[:, :nv], y_loc, saved[0], coef,
                      ctx.temperature, ctx.thr, ctx.has_neginf, bufs)
        return grad.view_as(logits), None, None, None, None, None


def check_min_p(min_p) -> Optional[float]:
    if min_p is not None and not 0.0 <= float(min_p) <= 1.0:
        raise ValueError(f"min_p: must lie in [0, 1] (a fraction of the top token's probability), got {min_p}")
    return None if min_p is None else float(min_p)


def vocab_parallel_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    min_p: Optional[float] = None,
    chunk_size: Optional[int] = None,
) -> VocabStats:
    """Per-token log-prob, entropy and sum pi^2 (and the DVP min-p pruned log-prob) of ``targets``.

    Args:
        logits: ``[*, V_local]`` float logits; this rank's columns of the padded vocabulary. Never
            modified. bf16/fp16 inputs are upcast chunk by chunk (statistics in fp32).
        targets: ``[*]`` int64 global token ids in ``[0, vocab_size)``, identical on every TP rank.
        tp_group: the tensor-parallel group the vocabulary is sharded over; ``None`` = unsharded.
        vocab_size: real vocabulary size; columns at or beyond it are padding. Default: no padding.
        temperature: logits are divided by it first.
        min_p: DVP safe set ``K = {v : pi_v >= min_p * max_u pi_u}`` (temperature applied first);
            ``0`` keeps everything. Enables ``pruned_logprobs``, ``kept_mass``, ``target_kept``.
        chunk_size: rows per chunk (default: ~4M elements per buffer on CPU, ~64M on GPU).
    """
    shard = sh.make_shard(logits, tp_group, vocab_size)
    sh.check_targets(targets, logits, shard)
    temperature = sh.check_temperature(temperature)
    min_p = check_min_p(min_p)
    sh.check_group_consistency(shard, targets.numel(), targets)
    chunk = sh.default_chunk_rows(shard.v_local, logits.device, chunk_size)  # equal on every rank
    outs = _VocabParallelStats.apply(logits, targets.long(), shard, temperature, min_p, chunk)
    return VocabStats(*outs)
