"""Dynamic Vocabulary Pruning (DVP, arXiv 2512.23087; math_spec §b): pruned log-probs over a safe set.

The safe set K(c) ⊆ V is given by a per-row *logit threshold* τ: K = {v : z_v >= τ}, where z are the
temperature-scaled logits (temperature first, then pruning, as the samplers do). Every rule is a way
to find τ under vocabulary (tensor) parallelism:

============  =====================================  =============================================
rule          τ                                      forward collectives (per row chunk, on TP)
============  =====================================  =============================================
min_p         M + log p                              none beyond P1
abs_logprob   min(LSE + a, M)  (log π_v >= a; the    none beyond P1
              argmax is always kept)
top_k         global k-th largest logit              one all-gather of the local top-k values
top_p         largest τ with π({z >= τ}) >= p        ``bisection_iters`` AR-SUMs of one float per row
              (per-row bisection on τ)               + one AR-MAX for the global minimum logit
============  =====================================  =============================================

P1 (shared by all): AR-MAX of the row maxima M and AR-SUM of Σ e^{z−M}. Then one fused AR-SUM of
[S_{K∪{y}}, S_K, z_y, 1[y∈K]] gives

    log π_K(y) = z_y − M − log S_{K∪{y}}     (target force-included in the normaliser)
    Z_K        = S_K / S                     (kept mass of the rule's own set; 1 − Z_K = TV(π, π_K))

Backward (no communication; K held fixed, it is piecewise constant in z):
∂ log π_K(y)/∂z_v = 1[v=y] − π_{K∪{y}}(v)·1[v ∈ K∪{y}], divided by the temperature; pruned and padding
columns get exactly zero gradient. Rows are processed in chunks of ``chunk_size`` so the ``[rows,
V_local]`` temporaries stay bounded; τ, M and S_{K∪{y}} (three floats per row) are saved for backward.

Ties at the threshold are kept (``>=``) on every path, so top-k may keep more than k tokens when
logits tie; the engine must use the same convention (§b.4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron_rl.config.objective import OUT_OF_SET, RULES, DVPConfig  # noqa: F401

Tensor = torch.Tensor




# ----------------------------------------------------------------------------------------------
# Threshold rules. Each gets the chunk's scaled logits z [rows, V_local] (padding = -inf), the global
# row max M and Σ e^{z-M} = S (both already all-reduced), and returns τ [rows]. No autograd here.
# ----------------------------------------------------------------------------------------------


def _active(group) -> bool:
    return group is not None and dist.is_initialized() and dist.get_world_size(group) > 1


def _all_reduce(x: Tensor, op, group) -> Tensor:
    if _active(group):
        dist.all_reduce(x, op=op, group=group)
    return x


class SafeSetRule:
    def threshold(self, z: Tensor, M: Tensor, S: Tensor, tp_group) -> Tensor:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass(frozen=True)
class MinP(SafeSetRule):
    p: float

    def threshold(self, z, M, S, tp_group):
        # π_v >= p max π  <=>  z_v >= M + log p  (math_spec check 5): no collective beyond P1.
        return M + math.log(self.p) if self.p > 0 else torch.full_like(M, -math.inf)


@dataclass(frozen=True)
class AbsLogProb(SafeSetRule):
    logprob: float

    def threshold(self, z, M, S, tp_group):
        # log π_v = z_v − LSE >= a; capped at M so the argmax is always kept (K never empty).
        return torch.minimum(M + torch.log(S) + self.logprob, M)


@dataclass(frozen=True)
class TopK(SafeSetRule):
    k: int

    def threshold(self, z, M, S, tp_group):
        # Local top-k (padding -inf sorts last), all-gather [rows, P*k], global k-th value.
        kk = min(self.k, z.shape[-1])
        local = z.topk(kk, dim=-1).values
        if kk < self.k:
            local = torch.cat([local, local.new_full((z.shape[0], self.k - kk), -math.inf)], -1)
        if _active(tp_group):
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
            dist.all_gather(parts, local.contiguous(), group=tp_group)
            local = torch.cat(parts, -1)
        return local.topk(self.k, dim=-1).values[:, -1]


@dataclass(frozen=True)
class TopP(SafeSetRule):
    p: float
    iters: int = 48

    def threshold(self, z, M, S, tp_group):
        # mass(τ) = Σ_{z>=τ} e^{z−M} / S is non-increasing in τ; we want its largest τ with mass >= p,
        # which is the logit of the last token of the nucleus. Bisection keeps mass(lo) >= p > mass(hi);
        # every iteration is one batched AR-SUM of one float per row (identical iteration count on
        # every rank, so the collectives match).
        zmin = torch.where(torch.isfinite(z), z, torch.full_like(z, math.inf)).amin(-1)
        lo = -_all_reduce((-zmin).contiguous(), dist.ReduceOp.MAX, tp_group)
        hi = M.clone()
        e = torch.exp(z - M[:, None])
        zero = torch.zeros((), dtype=z.dtype, device=z.device)

        def mass(tau):
            part = torch.where(z >= tau[:, None], e, zero).sum(-1)
            return _all_reduce(part.contiguous(), dist.ReduceOp.SUM, tp_group) / S

        top_enough = mass(M) >= self.p
        for _ in range(self.iters):
            mid = 0.5 * (lo + hi)
            ge = mass(mid) >= self.p
            lo = torch.where(ge, mid, lo)
            hi = torch.where(ge, hi, mid)
        return torch.where(top_enough, M, lo)


# ----------------------------------------------------------------------------------------------
# The differentiable pruned log-prob.
# ----------------------------------------------------------------------------------------------


def _scaled(logits: Tensor, temperature: float, vocab_start: int, vocab_size: int) -> Tensor:
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = logits.to(dt) / temperature
    cols = torch.arange(vocab_start, vocab_start + z.shape[-1], device=z.device)
    return torch.where(cols < vocab_size, z, torch.full((), -math.inf, dtype=dt, device=z.device))


def _target_index(targets: Tensor, vocab_start: int, v_local: int):
    local = (targets >= vocab_start) & (targets < vocab_start + v_local)
    return local, (targets - vocab_start).clamp(0, v_local - 1)


class PrunedTargetLogProb(torch.autograd.Function):
    """log π_{K∪{y}}(y), Z_K and 1[y ∈ K] for a threshold rule over vocabulary-sharded logits.

    Forward collectives per row chunk (on ``tp_group``): AR-MAX (row max), AR-SUM (Σ e^{z−M}), the
    rule's own (see module table), one fused AR-SUM of four floats per row. Backward: none.
    Inputs: logits ``[rows, V_local]``, targets ``[rows]`` (global ids). Outputs ``[rows]``.
    """

    @staticmethod
    def forward(ctx, logits, targets, rule, tp_group, vocab_start, vocab_size, temperature, chunk_size):
        rows, v_local = logits.shape
        dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
        lp = torch.empty(rows, dtype=dt, device=logits.device)
        mass = torch.empty(rows, dtype=dt, device=logits.device)
        kept = torch.empty(rows, dtype=torch.bool, device=logits.device)
        saved = torch.empty(3, rows, dtype=dt, device=logits.device)  # τ, M, S_{K∪{y}}
        step = chunk_size or max(rows, 1)
        for a in range(0, rows, step):
            b = min(rows, a + step)
            z = _scaled(logits[a:b], temperature, vocab_start, vocab_size)
            M = _all_reduce(z.amax(-1).contiguous(), dist.ReduceOp.MAX, tp_group)
            e = torch.exp(z - M[:, None])
            S = _all_reduce(e.sum(-1).contiguous(), dist.ReduceOp.SUM, tp_group)
            tau = rule.threshold(z, M, S, tp_group)
            keep = z >= tau[:, None]
            local, idx = _target_index(targets[a:b], vocab_start, v_local)
            keep_f = keep.clone()
            keep_f[local.nonzero().squeeze(-1), idx[local]] = True
            zero = torch.zeros((), dtype=dt, device=z.device)
            z_y = torch.where(local, z.gather(-1, idx[:, None]).squeeze(-1), zero)
            y_in = torch.where(local, keep.gather(-1, idx[:, None]).squeeze(-1).to(dt), zero)
            buf = torch.stack([torch.where(keep_f, e, zero).sum(-1), torch.where(keep, e, zero).sum(-1), z_y, y_in])
            S_kf, S_k, z_y, y_in = _all_reduce(buf.contiguous(), dist.ReduceOp.SUM, tp_group)
            lp[a:b] = z_y - M - torch.log(S_kf)
            mass[a:b] = S_k / S
            kept[a:b] = y_in > 0.5
            saved[:, a:b] = torch.stack([tau, M, S_kf])
        ctx.save_for_backward(logits, targets, saved)
        ctx.cfg = (vocab_start, vocab_size, temperature, chunk_size)
        ctx.mark_non_differentiable(mass, kept)
        return lp, mass, kept

    @staticmethod
    def backward(ctx, grad_lp, _grad_mass, _grad_kept):
        logits, targets, saved = ctx.saved_tensors
        vocab_start, vocab_size, temperature, chunk_size = ctx.cfg
        rows, v_local = logits.shape
        grad = torch.empty_like(logits)
        step = chunk_size or max(rows, 1)
        for a in range(0, rows, step):
            b = min(rows, a + step)
            z = _scaled(logits[a:b], temperature, vocab_start, vocab_size)
            tau, M, S_kf = saved[:, a:b]
            local, idx = _target_index(targets[a:b], vocab_start, v_local)
            keep_f = z >= tau[:, None]
            keep_f[local.nonzero().squeeze(-1), idx[local]] = True
            g = grad_lp[a:b].to(z.dtype)
            zero = torch.zeros((), dtype=z.dtype, device=z.device)
            p_kf = torch.where(keep_f, torch.exp(z - M[:, None]) / S_kf[:, None], zero)
            gz = -g[:, None] * p_kf
            gz[local.nonzero().squeeze(-1), idx[local]] += g[local]
            grad[a:b] = (gz / temperature).to(logits.dtype)
        return grad, None, None, None, None, None, None, None


@dataclass
class PrunedStats:
    """Per-token DVP outputs shaped like the targets: ``logprobs`` (differentiable), ``kept_mass``
    (Z_K, no grad), ``target_kept`` (bool)."""

    logprobs: Tensor
    kept_mass: Tensor
    target_kept: Tensor


def pruned_token_stats(logits: Tensor, targets: Tensor, cfg: DVPConfig, *, tp_group=None,
                       vocab_size: Optional[int] = None, temperature: float = 1.0,
                       chunk_size: Optional[int] = None) -> PrunedStats:
    """DVP log-probs of ``targets`` ``[*]`` from vocabulary-sharded ``logits`` ``[*, V_local]``.

    Rank r of ``tp_group`` holds columns ``[r·V_local, (r+1)·V_local)`` of the padded vocabulary;
    columns >= ``vocab_size`` are padding. ``ops.vocab_parallel_stats(min_p=...)`` computes the same
    min-p quantities fused with entropy and Σπ²; this function serves every rule.
    """
    if not temperature > 0:
        raise ValueError(f"pruned_token_stats: temperature={temperature} must be > 0")
    v_local = logits.shape[-1]
    tp_rank = dist.get_rank(tp_group) if _active(tp_group) else 0
    tp_size = dist.get_world_size(tp_group) if _active(tp_group) else 1
    vocab_size = v_local * tp_size if vocab_size is None else vocab_size
    lp, mass, kept = PrunedTargetLogProb.apply(
        logits.reshape(-1, v_local), targets.reshape(-1), safe_set_rule(cfg), tp_group, tp_rank * v_local,
        vocab_size, float(temperature), chunk_size,
    )
    shape = targets.shape
    return PrunedStats(lp.reshape(shape), mass.reshape(shape), kept.reshape(shape))


def out_of_set_keep(target_kept: Optional[Tensor], valid: Tensor, cfg: DVPConfig) -> Optional[Tensor]:
    """Token keep mask of the out-of-set policy (``None`` = keep all). ``mask`` rejects y ∉ K."""
    if not cfg.enabled or cfg.out_of_set != "mask":
        return None
    if target_kept is None:
        raise ValueError("DVPConfig.out_of_set='mask' needs LossInputs.target_kept (from pruned_token_stats or "
                         "ops.vocab_parallel_stats(min_p=...)); or use out_of_set='force_include'")
    return target_kept | ~valid


def safe_set_rule(cfg: DVPConfig) -> SafeSetRule:
    """The configured rule as the object the fused log-prob applies."""
    if cfg.rule == "min_p":
        return MinP(cfg.min_p)
    if cfg.rule == "top_k":
        return TopK(cfg.top_k)
    if cfg.rule == "top_p":
        return TopP(cfg.top_p, cfg.bisection_iters)
    return AbsLogProb(cfg.abs_logprob)
