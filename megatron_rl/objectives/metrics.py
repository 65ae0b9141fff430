"""Diagnostics of every objective (math_spec §a.4, §b.3, §e.4, §f.1), reduced with few collectives.

:class:`MetricBuilder` collects (sum, count) pairs and maxima, then reduces them all at once: token
statistics are summed over CP and DP, sequence statistics (already complete per sequence) over DP
only — so a sequence split across CP ranks is counted once — and maxima over both. A metric whose
population is empty on every rank is omitted (verl raises there; we return fewer keys).

Metric names (each present only when its inputs are):

* ``mismatch/``: ``k1``, ``k3`` (the "vllm-kl"), ``abs_diff`` (mean |log π_a − log μ|),
  ``chi2_token``, ``max_k2``, ``max_exact_kl`` (max token
  divergence), per sequence ``chi2_seq``, ``log_ppl_abs_diff``, ``ppl_ratio`` (PPL_a / PPL_μ),
  ``seq_k3_sum`` (D^seq_KL estimate) — over *valid* tokens, before rejection;
* ``correction/``: ``seq_acceptance``, ``token_keep_frac``, ``rejected/<rule>``;
* ``is/``: ``weight_mean``, ``weight_min``, ``weight_max``, ``ess`` (= mean(w)²/mean(w²) ∈ (0, 1]),
  ``truncated_frac``, over surviving tokens (or sequences, for sequence-level weights);
* ``trm/``: ``acceptance_rate``, ``max_div``, ``mean_div``, ``seq_div_sum``, ``bound_*`` (the paper's
  bounds for this batch: δ = max_div, D^seq_KL = seq_div_sum, ε = max exact TV or Pinsker; the adaptive
  bound and ε from TV only on the exact path; on the sample path they are estimates, not guarantees);
* ``dvp/``: ``kept_mass`` (Z_K), ``pruned_mass`` (1 − Z_K, the bias), ``pruned_mass_per_seq``,
  ``target_outside_frac``;
* ``routing_mask/``: ``disagreement`` (token mean of ``routing_disagreement``), ``seq_disagreement``,
  ``token_keep_frac`` or ``seq_acceptance`` (by level);
* ``policy/``: ``clip_frac``, ``clip_frac_high``, ``clip_frac_low``, ``dual_clip_frac``,
  ``approx_kl_k1``, ``approx_kl_k3``;
* ``versions/`` (with ``policy_version``): ``spanning_token_frac`` (tokens of sequences that span several weight
  versions), ``max_span`` (largest version difference inside a sequence); ``mismatch/k3_spanning`` is the k3
  over those tokens;
* ``loss/``: the step-global value of each term; ``tokens/``: ``valid``, ``kept``, ``nonfinite``;
  ``entropy``, ``kl_ref``, ``logit_grad_proxy`` (1 − 2π_y + Σπ², §d.1).
"""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch

from megatron_rl.objectives.divergence import clamp_log_ratio, k3
from megatron_rl.objectives.reduce import (
    ReduceGroups, all_reduce, cp_positions, position_mean, seq_count, seq_sum_count,
)
from megatron_rl.objectives.trm_bounds import trm_bounds

Tensor = torch.Tensor


class MetricBuilder:
    def __init__(self, groups: ReduceGroups = ReduceGroups()):
        self.groups = groups
        self._tok: List[Tuple[str, Tensor, Tensor]] = []  # summed over CP and DP
        self._seq: List[Tuple[str, Tensor, Tensor]] = []  # summed over DP
        self._totals: set = set()  # names reported as sums, not means
        self._max: List[Tuple[str, Tensor, bool]] = []  # (name, value, negated)

    @staticmethod
    def _pair(values: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor]:
        v = values.detach().to(torch.float64)
        return torch.where(mask, v, torch.zeros((), dtype=torch.float64, device=v.device)).sum(), mask.sum().double()

    def token_mean(self, name: str, values: Tensor, mask: Tensor) -> None:
        self._tok.append((name, *self._pair(values, mask)))

    def seq_mean(self, name: str, values: Tensor, mask: Tensor) -> None:
        """``values``/``mask`` ``[B]``: per-sequence quantities already reduced over CP."""
        self._seq.append((name, *self._pair(values, mask)))

    def total(self, name: str, value: Tensor) -> None:
        """A per-rank contribution (e.g. this rank's share of a loss) summed over CP and DP."""
        v = value.detach().to(torch.float64).reshape(())
        self._tok.append((name, v, torch.ones((), dtype=torch.float64, device=v.device)))
        self._totals.add(name)

    def max(self, name: str, values: Tensor, mask: Tensor, _negate: bool = False) -> None:
        v = values.detach().to(torch.float64)
        v = -v if _negate else v
        ninf = torch.full((), -math.inf, dtype=torch.float64, device=v.device)
        self._max.append((name, torch.where(mask, v, ninf).amax() if v.numel() else ninf, _negate))

    def min(self, name: str, values: Tensor, mask: Tensor) -> None:
        self.max(name, values, mask, _negate=True)

    def finalize(self) -> Dict[str, Tensor]:
        """One AR-SUM over CP, one over DP, one AR-MAX over each; identical keys on every rank."""
        out: Dict[str, Tensor] = {}
        g = self.groups
        if self._tok or self._seq:
            parts = []
            if self._tok:
                tok = torch.stack([torch.stack([n, d]) for _, n, d in self._tok])
                parts.append(all_reduce(tok.contiguous(), "sum", g.cp))
            if self._seq:
                parts.append(torch.stack([torch.stack([n, d]) for _, n, d in self._seq]))
            both = all_reduce(torch.cat(parts).contiguous(), "sum", g.dp)
            names = [e[0] for e in self._tok] + [e[0] for e in self._seq]
            for i, (name, den) in enumerate(zip(names, both[:, 1].tolist())):
                if name in self._totals:
                    out[name] = both[i, 0]
                elif den > 0:
                    out[name] = both[i, 0] / both[i, 1]
        if self._max:
            mx = all_reduce(torch.stack([v for _, v, _ in self._max]).contiguous(), "max", g.cp, g.dp)
            for (name, _, neg), v, f in zip(self._max, mx, mx.tolist()):
                if f != -math.inf:
                    out[name] = -v if neg else v
        return out


def objective_metrics(sel, term, is_scale: Tensor, parts: Dict[str, Tensor], cfg,
                      groups: ReduceGroups = ReduceGroups()) -> Dict[str, Tensor]:
    """All diagnostics of one micro-batch. ``sel`` is a :class:`~selection.Selection`, ``term`` the
    :class:`~policy_loss.PolicyTerm`, ``is_scale`` the batch-normalisation divisor of the IS weights
    (1 without), ``parts`` the loss terms (this rank's contributions)."""
    mb = MetricBuilder(groups)
    extra: Dict[str, Tensor] = {}
    x, valid, keep = sel.inputs, sel.valid, sel.keep
    seq_nonempty = sel.stats.nonempty if sel.stats is not None else None

    mb.total("tokens/valid", valid.sum())
    mb.total("tokens/kept", keep.sum())
    mb.total("tokens/nonfinite", sel.n_nonfinite)
    for name, value in parts.items():
        mb.total(f"loss/{name}", value)

    if sel.log_ratio is not None:
        lr, st = sel.log_ratio, sel.stats
        mb.token_mean("mismatch/k1", -lr, valid)
        mb.token_mean("mismatch/k3", k3(lr), valid)
        mb.token_mean("mismatch/abs_diff", lr.abs(), valid)
        mb.token_mean("mismatch/_exp2", torch.exp(2 * lr), valid)
        mb.max("mismatch/max_k2", st.max_k2, seq_nonempty)
        mb.seq_mean("mismatch/_exp2_seq", torch.exp(2 * clamp_log_ratio(st.sum_log_ratio)), seq_nonempty)
        mb.seq_mean("mismatch/log_ppl_abs_diff", st.mean_log_ratio.abs(), seq_nonempty)
        mb.seq_mean("mismatch/ppl_ratio", torch.exp(-st.mean_log_ratio), seq_nonempty)
        mb.seq_mean("mismatch/seq_k3_sum", st.sum_k3, seq_nonempty)
    if x.policy_version is not None:
        _version_metrics(mb, x.policy_version, valid, sel.log_ratio, groups)
    if sel.stats is not None and sel.stats.max_exact is not None:
        mb.max("mismatch/max_exact_kl", sel.stats.max_exact, seq_nonempty)
        mb.token_mean("mismatch/exact_kl", x.rollout_kl, valid)

    if sel.routing is not None:
        r = sel.routing
        mb.token_mean("routing_mask/disagreement", x.routing_disagreement, valid)
        mb.seq_mean("routing_mask/seq_disagreement", r.seq_disagreement, r.nonempty)
        if cfg.routing_mask.level == "token":
            mb.token_mean("routing_mask/token_keep_frac", r.token_keep.double(), valid)
        else:
            mb.seq_mean("routing_mask/seq_acceptance", r.seq_keep.double(), r.nonempty)
    if sel.correction is not None or sel.trm is not None or sel.dvp_keep is not None or sel.routing is not None:
        mb.token_mean("correction/token_keep_frac", keep.double(), valid)
        nonempty = seq_nonempty if seq_nonempty is not None else (sel.routing.nonempty if sel.routing else None)
        if nonempty is not None:
            mb.seq_mean("correction/seq_acceptance", sel.seq_keep.double(), nonempty)
    if sel.correction is not None:
        c = sel.correction
        for rule, rejected in c.rejected_by.items():
            if rejected.dim() == 2:
                mb.token_mean(f"correction/rejected/{rule}", rejected.double(), valid)
            else:
                mb.seq_mean(f"correction/rejected/{rule}", rejected.double(), seq_nonempty)
        if cfg.correction.is_level is not None:
            if sel.seq_weights is not None:
                w, m, add_mean = sel.seq_weights / is_scale, seq_count(keep, groups.cp) > 0, mb.seq_mean
            else:
                w, m, add_mean = sel.weights / is_scale, keep, mb.token_mean
            add_mean("is/weight_mean", w, m)
            add_mean("is/_weight_sq", w.square(), m)
            mb.max("is/weight_max", w, m)
            mb.min("is/weight_min", w, m)
            mb.token_mean("is/truncated_frac", c.is_truncated.double(), valid)

    if sel.trm is not None:
        t = sel.trm
        mb.seq_mean("trm/acceptance_rate", t.keep.double(), seq_nonempty)
        mb.max("trm/max_div", t.max_div, seq_nonempty)
        mb.seq_mean("trm/mean_div", t.mean_div, seq_nonempty)
        mb.seq_mean("trm/seq_div_sum", t.sum_div, seq_nonempty)
        # T of the bounds: the longest response span in columns (>= its generated tokens; every bound is
        # monotone in T, so they stay upper bounds with tool segments inside a response)
        span = cp_positions(valid.shape[-1], groups.cp_columns, valid.device)[None, :].expand_as(valid) + 1
        mb.max("trm/_span", span, valid)
        if cfg.trm.log_bounds and t.exact:
            # per-token TV: exact when given, else Pinsker's bound on the exact KL (keeps the bound valid)
            tv = x.rollout_tv if x.rollout_tv is not None else torch.sqrt(x.rollout_kl.clamp(min=0) / 2).clamp(max=1)
            mb.max("trm/_max_tv", tv, valid)
            extra["mean_tv_per_position"] = position_mean(tv, valid, groups.cp, groups.dp, groups.cp_zigzag)

    if x.kept_mass is not None:
        mb.token_mean("dvp/kept_mass", x.kept_mass, valid)
        mb.token_mean("dvp/pruned_mass", 1 - x.kept_mass, valid)
        pruned, n = seq_sum_count(1 - x.kept_mass, valid, groups.cp)
        mb.seq_mean("dvp/pruned_mass_per_seq", pruned, n > 0)
    if x.target_kept is not None:
        mb.token_mean("dvp/target_outside_frac", (~x.target_kept).double(), valid)

    if cfg.policy.loss != "reinforce":
        mb.token_mean("policy/clip_frac", (term.clipped_high | term.clipped_low).double(), keep)
        mb.token_mean("policy/clip_frac_high", term.clipped_high.double(), keep)
        mb.token_mean("policy/clip_frac_low", term.clipped_low.double(), keep)
        mb.token_mean("policy/dual_clip_frac", term.dual_clipped.double(), keep)
        lr_pol = clamp_log_ratio(x.logprobs.detach() - sel.anchor)
        mb.token_mean("policy/approx_kl_k1", -lr_pol, keep)
        mb.token_mean("policy/approx_kl_k3", k3(lr_pol), keep)
    if x.entropy is not None:
        mb.token_mean("entropy", x.entropy, valid)
    if x.sum_pi_squared is not None:
        proxy = (1 - 2 * torch.exp(x.logprobs.detach()) + x.sum_pi_squared).clamp(min=0)
        mb.token_mean("logit_grad_proxy", proxy, valid)

    out = mb.finalize()
    _derive(out, cfg, extra)
    return out


def _version_metrics(mb: MetricBuilder, version: Tensor, valid: Tensor, log_ratio, groups: ReduceGroups) -> None:
    """Sequences whose tokens come from several weight versions (partial rollouts), and their mismatch."""
    v = version.to(torch.float64)
    ninf = torch.full((), -math.inf, dtype=torch.float64, device=v.device)
    ends = all_reduce(torch.stack([torch.where(valid, v, ninf).amax(-1), torch.where(valid, -v, ninf).amax(-1)]),
                      "max", groups.cp)  # [2, B]: per-sequence max and -min over every CP rank's positions
    nonempty = torch.isfinite(ends[0])
    span = torch.where(nonempty, ends[0] + ends[1], torch.zeros((), dtype=torch.float64, device=v.device))
    spanning = valid & (span > 0)[:, None]
    mb.token_mean("versions/spanning_token_frac", spanning.double(), valid)
    mb.max("versions/max_span", span, nonempty)
    if log_ratio is not None:
        mb.token_mean("mismatch/k3_spanning", k3(log_ratio), spanning)


def _derive(out: Dict[str, Tensor], cfg, extra: Dict[str, Tensor]) -> None:
    """Metrics that are nonlinear in global means (χ², ESS, TRM bounds), from the reduced values."""
    if "mismatch/_exp2" in out:
        out["mismatch/chi2_token"] = out.pop("mismatch/_exp2") - 1
    if "mismatch/_exp2_seq" in out:
        out["mismatch/chi2_seq"] = out.pop("mismatch/_exp2_seq") - 1
    if "is/_weight_sq" in out:
        sq = out.pop("is/_weight_sq")
        out["is/ess"] = out["is/weight_mean"].square() / sq.clamp(min=1e-30)
    span = out.pop("trm/_span", None)
    max_tv = out.pop("trm/_max_tv", None)
    if cfg.trm.enabled and cfg.trm.log_bounds and span is not None and "trm/max_div" in out:
        T = int(span)
        delta = max(float(out["trm/max_div"]), 0.0)
        dkl = max(float(out["trm/seq_div_sum"]), 0.0)
        eps = float(max_tv) if max_tv is not None else None
        dbar = extra.get("mean_tv_per_position")
        if dbar is not None:
            dbar = dbar[:T].double().cpu().numpy()
        if math.isfinite(delta) and math.isfinite(dkl):
            for k, v in trm_bounds(T, delta, eps=eps, dkl_seq=dkl, mean_tv_per_position=dbar).as_metrics().items():
                if math.isfinite(v):  # the adaptive bound needs the exact path
                    out[k] = torch.tensor(v, dtype=torch.float64)
