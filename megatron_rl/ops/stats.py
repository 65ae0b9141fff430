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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.ops import _shard as sh


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
        v_local, nv = shard.v_local, shard.n_valid
        x = logits.reshape(-1, v_local)
        y = targets.reshape(-1)
        rows = x.shape[0]
        cd = sh.compute_dtype(logits.dtype)
        f = dict(dtype=cd, device=logits.device)
        y_loc, owned = sh.local_targets(y, shard)
        dvp = min_p is not None
        keys = ("S", "Ez", "E2", "zy") + (("SK", "ey") if dvp else ())
        out = {k: torch.empty(rows, **f) for k in ("M",) + keys}
        if dvp:
            # e >= min_p  <=>  e > thr, with the comparison in the compute dtype on both passes.
            np_t = np.float64 if cd == torch.float64 else np.float32
            ctx.min_p_thr = float(np.nextafter(np_t(min_p), np_t(0)))
        c_max = max(1, min(chunk, rows))
        zbuf = torch.empty(c_max, nv, **f)  # z - M
        ebuf = torch.empty(c_max, nv, **f)  # exp(z - M)
        tmp = torch.empty(c_max, nv, **f)
        has_neginf = False
        for s, t in sh.row_chunks(rows, c_max):
            c = t - s
            if nv:
                zc = sh.load_chunk(x[s:t, :nv], zbuf, temperature)
                m = zc.amax(-1)
            else:
                m = torch.full((c,), -torch.inf, **f)
            shard.all_reduce(m, dist.ReduceOp.MAX)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all--inf rows: avoid -inf - -inf
            sums = torch.zeros(len(keys), c, **f)
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
                    kept = torch.threshold(e, ctx.min_p_thr, 0.0, out=zbuf[:c])  # zs no longer needed
                    sums[4] = kept.sum(-1)
            shard.all_reduce(sums)
            out["M"][s:t] = m
            for i, k in enumerate(keys):
                out[k][s:t] = sums[i]
        S, zy = out["S"], out["zy"]
        log_s = S.log()
        logprobs = zy - log_s
        entropy = log_s - out["Ez"] / S
        sum_pi_sq = out["E2"] / (S * S)
        ctx.shard, ctx.temperature, ctx.chunk, ctx.has_neginf, ctx.dvp = shard, temperature, c_max, has_neginf, dvp
        ctx.shape = targets.shape
        ctx.mark_non_differentiable(sum_pi_sq)
        shape = targets.shape
        if not dvp:
            ctx.save_for_backward(logits, y_loc, owned, out["M"], S, entropy)
            return logprobs.view(shape), entropy.view(shape), sum_pi_sq.view(shape)
        e_y = out["ey"]
        target_kept = e_y > ctx.min_p_thr
        sk_full = out["SK"] + torch.where(target_kept, torch.zeros_like(e_y), e_y)
        pruned = zy - sk_full.log()
        kept_mass = out["SK"] / S
        ctx.mark_non_differentiable(kept_mass, target_kept)
        ctx.save_for_backward(logits, y_loc, owned, out["M"], S, entropy, sk_full, target_kept, e_y)
        return (
            logprobs.view(shape),
            entropy.view(shape),
            sum_pi_sq.view(shape),
            pruned.view(shape),
            kept_mass.view(shape),
            target_kept.view(shape),
        )

    @staticmethod
    def backward(ctx, g_lp, g_h, _g_spi2, g_pl=None, _g_km=None, _g_tk=None):
        logits, y_loc, owned, M, S, H, *dvp_saved = ctx.saved_tensors
        if g_lp is None and g_h is None and g_pl is None:
            return (None,) * 6
        shard, temperature = ctx.shard, ctx.temperature
        v_local, nv = shard.v_local, shard.n_valid
        x = logits.reshape(-1, v_local)
        rows = x.shape[0]
        cd = S.dtype
        f = dict(dtype=cd, device=logits.device)
        zero = torch.zeros(rows, **f)
        g_lp = zero if g_lp is None else g_lp.reshape(-1).to(cd)
        entropy = g_h is not None
        g_h = zero if g_h is None else g_h.reshape(-1).to(cd)
        dvp = ctx.dvp and g_pl is not None
        g_pl = zero if g_pl is None else g_pl.reshape(-1).to(cd)
        # grad_z = e * (alpha + beta * (z - M)) - gamma * e * [v in K] + onehot_y * delta, where
        # d log pi(y) = 1[v=y] - pi,  dH = -pi (log pi + H),  d log pi_K(y) = 1[v=y] - pi_K [v in K'].
        inv_s = 1.0 / S
        log_s = S.log()
        alpha = (g_h * (log_s - H) - g_lp) * inv_s
        beta = -g_h * inv_s
        delta = g_lp + g_pl
        if dvp:
            sk_full, target_kept, e_y = dvp_saved
            gamma = g_pl / sk_full
            # A force-included target is in K' but not in the threshold mask: its -gamma * e_y here.
            delta = delta - torch.where(target_kept, zero, gamma * e_y)
        delta = torch.where(owned, delta, zero)

        grad = torch.empty(rows, v_local, dtype=logits.dtype, device=logits.device)
        if nv < v_local:
            grad[:, nv:] = 0
        if nv == 0:
            return grad.view_as(logits), None, None, None, None, None
        direct = grad.dtype == cd
        c_max = ctx.chunk
        zbuf = torch.empty(c_max, nv, **f)
        ebuf = torch.empty(c_max, nv, **f)
        ubuf = None if direct else torch.empty(c_max, nv, **f)
        for s, t in sh.row_chunks(rows, c_max):
            c = t - s
            zc = sh.load_chunk(x[s:t, :nv], zbuf, temperature)
            zs = sh.shifted(zc, M[s:t], zbuf)
            e = torch.exp(zs, out=ebuf[:c])
            u = grad[s:t, :nv] if direct else ubuf[:c]
            if entropy:
                if ctx.has_neginf:
                    zs.clamp_(min=-1e4)  # exp(-1e4) == 0 already; keeps 0 * -inf out of the product
                zs.mul_(beta[s:t, None]).add_(alpha[s:t, None])
                torch.mul(zs, e, out=u)
            else:
                torch.mul(e, alpha[s:t, None], out=u)
            if dvp:
                kept = torch.threshold(e, ctx.min_p_thr, 0.0, out=zbuf[:c])
                u.sub_(kept.mul_(gamma[s:t, None]))
            u.scatter_add_(1, y_loc[s:t, None], delta[s:t, None])
            if temperature != 1.0:
                u.div_(temperature)
            if not direct:
                grad[s:t, :nv].copy_(u)
        return grad.view_as(logits), None, None, None, None, None


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
    if min_p is not None and not 0.0 <= float(min_p) <= 1.0:
        raise ValueError(f"min_p: must lie in [0, 1] (a fraction of the top token's probability), got {min_p}")
    sh.check_group_consistency(shard, targets.numel(), targets)
    chunk = sh.default_chunk_rows(shard.n_valid, logits.device, chunk_size)
    outs = _VocabParallelStats.apply(
        logits, targets.long(), shard, temperature, None if min_p is None else float(min_p), chunk
    )
    return VocabStats(*outs)
