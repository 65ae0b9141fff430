"""``megatron-rl report RUN_DIR [--out DIR]``: one HTML page with PNG plots (matplotlib) of a run's
``metrics.jsonl`` — what a user would otherwise assemble by hand in tensorboard.

Panels (each drawn only when its metrics are in the run): rewards and evaluation (warm-up shaded) with
the reward entropy in bits per episode; the training–inference mismatch (k3, the largest token
divergence, acceptance rates, IS effective sample size); bounds vs measurements (the gain
decomposition's bound on its remainder, R_max times the sequence KL, vs the measured remainder and tangent;
TRM's bounds on the surrogate error when TRM logs them); routing agreement per MoE layer; the time of each phase stacked
per step; throughput (tokens/s, per GPU and MFU when logged); the LR with the response length the
length-surge schedule watches (and its state when logged). Written to ``RUN_DIR/report/`` by default:
``index.html`` and one PNG per panel. Noisy per-step series are drawn faintly with a moving average; a
series equal to one already on its axes is drawn dashed on top and labelled "identical to ...". Every
quantity is defined in docs/report_formulas.md.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple

Series = Tuple[List[float], List[float]]


class Metrics:
    """A run's ``metrics.jsonl``: one dict per logged step (non-finite values come back as NaN)."""

    def __init__(self, lines: Sequence[Dict[str, float]]):
        self.lines = sorted(lines, key=lambda m: m.get("step", 0))
        self.keys = sorted({k for m in self.lines for k in m if k != "step"})

    @classmethod
    def read(cls, run_dir: str) -> "Metrics":
        path = os.path.join(run_dir, "metrics.jsonl")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is it a run's logging.output_dir?)")
        lines = []
        with open(path) as f:
            for line in f:
                try:
                    lines.append({k: _num(v) for k, v in json.loads(line).items()})
                except ValueError:
                    continue  # a line torn by a crash
        return cls(lines)

    def series(self, key: str) -> Series:
        pts = [(m["step"], m[key]) for m in self.lines if key in m and math.isfinite(m[key])]
        return [p[0] for p in pts], [p[1] for p in pts]

    def has(self, key: str) -> bool:
        return bool(self.series(key)[0])

    def matching(self, pattern: str) -> List[str]:
        return [k for k in self.keys if re.fullmatch(pattern, k) and self.has(k)]


def _num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def _smooth(y: List[float], n: int) -> List[float]:
    """Trailing moving average over ``n`` points."""
    out, acc = [], 0.0
    for i, v in enumerate(y):
        acc += v - (y[i - n] if i >= n else 0.0)
        out.append(acc / min(i + 1, n))
    return out


class _Plotter:
    def __init__(self, m: Metrics, out_dir: str):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self.plt, self.m, self.out_dir = plt, m, out_dir
        steps = [line.get("step", 0) for line in m.lines]
        self.window = max(1, len(steps) // 25)
        self.warmup = [s for s, v in zip(*m.series("train/warmup")) if v > 0]
        self._drawn: List[Tuple[int, list, list, str]] = []  # (axes, x, y, label) of the series drawn

    def _same_as(self, ax, x, y, label: str, kw: dict, rel: float = 0.01) -> str:
        """Coinciding series would hide one another: the later one is dashed (and wider) and its label says
        which it equals ("identical to": exactly; "within 1% of": indistinguishable at the plot's scale; log
        axes spanning decades use 5%)."""
        for other_ax, ox, oy, other in self._drawn:
            if other_ax == id(ax) and ox == list(x) and len(oy) == len(y):
                exact = list(oy) == list(y)
                if exact or all(abs(a - b) <= rel * max(abs(a), abs(b)) for a, b in zip(oy, y)):
                    kw.setdefault("ls", "--")
                    kw["lw"] = kw.get("lw", 1.4) + 0.6
                    self._drawn.append((id(ax), list(x), list(y), label))
                    return f"{label} ({'identical to' if exact else f'within {rel:.0%} of'} {other})"
        self._drawn.append((id(ax), list(x), list(y), label))
        return label

    def line(self, ax, key: str, label: Optional[str] = None, smooth: bool = False, **kw) -> bool:
        x, y = self.m.series(key)
        if not x:
            return False
        label = self._same_as(ax, x, y, label or key, kw)
        if smooth and len(y) > 2 * self.window > 2:
            lw = kw.pop("lw", None)
            base = ax.plot(x, y, alpha=0.25, lw=0.8, **kw)[0]
            ax.plot(x, _smooth(y, self.window), color=base.get_color(), lw=lw or 1.6, label=label,
                    ls=kw.get("ls", "-"))
        else:
            kw.setdefault("lw", 1.4)
            ax.plot(x, y, label=label, marker="o" if len(x) < 40 else None, ms=3, **kw)
        return True

    def shade_warmup(self, ax) -> None:
        if self.warmup:
            ax.axvspan(min(self.warmup) - 0.5, max(self.warmup) + 0.5, color="0.9", zorder=0, label="warm-up")

    def figure(self, rows: int = 1, height: float = 3.2):
        fig, axes = self.plt.subplots(rows, 1, figsize=(8, height * rows), sharex=True, squeeze=False)
        return fig, [a[0] for a in axes]

    def log_line(self, ax, key: str, label: str, **kw) -> bool:
        """|values| on a log axis, smoothed; zeros are left out (they carry no scale)."""
        x, y = self.m.series(key)
        pts = [(s, abs(v)) for s, v in zip(x, y) if v != 0]
        if not pts:
            return False
        xs, ys = [s for s, _ in pts], [v for _, v in pts]
        ys = _smooth(ys, self.window) if len(ys) > 2 * self.window else ys
        label = self._same_as(ax, xs, ys, label, kw, rel=0.05)
        ax.plot(xs, ys, label=label, **kw)
        ax.set_yscale("log")
        return True

    def save(self, fig, name: str, twin=None, legend_below: bool = False) -> str:
        """``twin``: (axis, its twinx): one legend for both, on the twin (drawn on top); ``legend_below``: that
        legend under the plot, off the data."""
        for ax in fig.axes:
            ax.grid(alpha=0.3)
            handles, labels = ax.get_legend_handles_labels()
            if twin is not None and ax in twin:
                continue
            if handles:
                ax.legend(fontsize=7, loc="best", ncol=2 if len(handles) > 4 else 1)
        if twin is not None:
            (h1, l1), (h2, l2) = (a.get_legend_handles_labels() for a in twin)
            if legend_below:
                twin[1].legend(h1 + h2, l1 + l2, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18),
                               ncol=3, frameon=False)
            else:
                twin[1].legend(h1 + h2, l1 + l2, fontsize=7, loc="best")
        min(fig.axes, key=lambda a: a.get_position().y0).set_xlabel("step")
        fig.tight_layout()
        path = os.path.join(self.out_dir, name)
        fig.savefig(path, dpi=90, bbox_inches="tight" if legend_below else None)
        self.plt.close(fig)
        return name


# ---- panels: each returns (png name, caption) or None when the run has none of its metrics -------------

def _rewards(p: _Plotter):
    m = p.m
    fig, (ax, ax2) = p.figure(2)
    p.shade_warmup(ax)
    drew = p.line(ax, "rollout/reward_mean", "rollout reward", smooth=True)
    drew |= p.line(ax, "batch/reward_mean", "train batch (after filtering)", smooth=True)
    drawn = []
    evals = m.matching(r"eval/(reward_mean|pass@\d+|[^/]+/(reward_mean|pass@\d+))")
    for key in sorted(evals, key=lambda k: (k != "eval/reward_mean", k)):
        if m.series(key) in drawn:  # pass@1 of one greedy sample with a 0/1 reward is the mean reward
            continue
        drawn.append(m.series(key))
        drew |= p.line(ax, key, "eval" + (" (greedy)" if key == "eval/reward_mean" else ": " + key[5:]))
    if not drew:
        p.plt.close(fig)
        return None
    ax.set_ylabel("reward")
    ax.set_title("rewards and evaluation")
    if p.line(ax2, "reward/entropy_bits", "reward entropy per episode", smooth=True):
        ax2.set_ylabel("bits")
    else:
        p.line(ax2, "rollout/reward_std", "rollout reward std", smooth=True)
    return p.save(fig, "rewards.png"), ("Mean reward of the rollouts and of the trained batch (faint: per step, "
                                        "bold: moving average), evaluation (greedy accuracy / pass@k); below, the "
                                        "information per episode: the entropy of the rewards within a prompt group "
                                        "(at most 1 bit for a pass/fail reward). Definitions: docs/report_formulas.md.")


def _mismatch(p: _Plotter):
    m = p.m
    keys = [("logprobs/mismatch_k3", "k3 (trainer vs engine, sampled tokens)"), ("mismatch/k3", "k3 (objective)"),
            ("mismatch/max_k2", "largest token ½λ² (λ = log-ratio)"), ("mismatch/max_exact_kl", "largest token KL (exact)"),
            ("logprobs/mismatch_max_abs", "largest |Δ log p|"), ("routing/logprob_abs_diff", "routing: mean |Δ log p|")]
    acc = [("correction/seq_acceptance", "sequence acceptance"), ("trm/acceptance_rate", "TRM acceptance"),
           ("correction/token_keep_frac", "token keep fraction"), ("is/ess", "IS effective sample size"),
           ("routing_mask/seq_acceptance", "routing-mask acceptance")]
    if not any(m.has(k) for k, _ in keys + acc):
        return None
    fig, (ax, ax2) = p.figure(2)
    for k, label in keys:
        p.log_line(ax, k, label, lw=1.2)
    ax.set_ylabel("divergence (log)")
    ax.set_title("training–inference mismatch")
    for k, label in acc:
        p.line(ax2, k, label, smooth=True)
    ax2.set_ylabel("fraction")
    ax2.set_ylim(-0.02, 1.05)
    return p.save(fig, "mismatch.png"), ("How far the trainer's log-probs of the sampled tokens are from those the "
                                          "rollout engine recorded: the mean KL estimate k3 and the largest single-"
                                          "token difference (log scale); below, the fraction of sequences / tokens "
                                          "the corrections keep and the importance weights' effective sample "
                                          "size. Coinciding series are dashed and marked identical. Definitions: "
                                          "docs/report_formulas.md.")


def _bounds(p: _Plotter):
    m = p.m
    trm = m.matching(r"trm/bound_(unified|pinsker_marginal_kl|mixed_kl|adaptive)")
    if not trm and not m.has("gain/slack"):
        return None
    ratio = m.has("gain/signal_to_slack")
    fig, axes = p.figure(2 if ratio else 1, 3.4)
    ax = axes[0]
    for k in trm:
        p.log_line(ax, k, k.replace("trm/bound_", "TRM bound: "), lw=1.2, ls="--")
    for k, label, style in (("gain/slack", "gain: bound on the remainder (R_max × sequence KL)", "--"),
                            ("gain/remainder", "gain: |remainder| (measured)", "-"),
                            ("gain/tangent", "gain: |tangent| (first order)", ":")):
        p.log_line(ax, k, label, ls=style, lw=1.4)
    ax.set_ylabel("reward units (log)")
    ax.set_title("bounds vs measured")
    if ratio:
        p.line(axes[1], "gain/signal_to_slack", "signal-to-slack: tangent / slack", smooth=True)
        axes[1].axhline(1.0, color="k", lw=0.8, ls=":")
        axes[1].set_ylabel("ratio")
    return p.save(fig, "bounds.png"), ("How much each update changed the expected reward, split into a first-order "
                                        "part (tangent) and the rest (remainder), measured on each step's batch; "
                                        "the remainder can never exceed R_max times the KL divergence between the "
                                        "policies before and after the update (dashed). Below: tangent / that "
                                        "bound; above 1 the first-order gain is larger than anything the step could "
                                        "lose. TRM's bounds on the surrogate error when TRM logs them. Formulas: "
                                        "docs/report_formulas.md.")


def _smoothed_lines(p: _Plotter, keys: List[str], prefix: str, ylabel: str, title: str):
    """One axis of smoothed series, labelled without ``prefix``."""
    fig, (ax,) = p.figure(1, 3.5)
    for k in keys:
        p.line(ax, k, k.replace(prefix, ""), smooth=True)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return fig, ax


def _routing(p: _Plotter):
    layers = sorted(p.m.matching(r"routing/agreement_layer\d+"), key=lambda k: int(k.rsplit("layer", 1)[1]))
    if not layers:
        return None
    fig, _ = _smoothed_lines(p, layers, "routing/agreement_", "top-k set agreement",
                             "MoE routing agreement per layer (trainer vs engine)")
    return p.save(fig, "routing.png"), "Fraction of tokens whose top-k expert set is the same in the trainer and the engine."


def _time(p: _Plotter):
    m = p.m
    phases = [k for k in m.matching(r"time/.+") if k not in ("time/step", "time/startup")]
    if not phases:
        return None
    steps = [line["step"] for line in m.lines if "time/step" in line]
    if not steps:
        return None
    rows = [[line.get(k, 0.0) if math.isfinite(line.get(k, 0.0)) else 0.0 for line in m.lines if "time/step" in line]
            for k in phases]
    order = sorted(range(len(phases)), key=lambda i: -sum(rows[i]))
    fig, (ax,) = p.figure(1, 3.8)
    ax.stackplot(steps, *[rows[i] for i in order], labels=[phases[i][5:] for i in order], alpha=0.85)
    totals = [line["time/step"] for line in m.lines if "time/step" in line]
    ax.plot(steps, totals, color="k", lw=0.6, label="step")
    ax.set_ylabel("seconds")
    ax.set_title("time per step, by phase")
    typical = sorted(totals)[len(totals) // 2]
    if max(totals) > 6 * typical > 0:  # a few slow steps (a loaded machine, checkpoints) would flatten the rest
        ax.set_ylim(0, 4 * typical)
        ax.set_title(f"time per step, by phase (clipped: slowest step {max(totals):.0f} s)")
    return p.save(fig, "time.png"), "Wall time of each driver phase per step, stacked; the black line is the whole step."


_THROUGHPUT = (("perf/rollout_tokens_per_s", "generation (generated tokens/s)"),
               ("perf/train_tokens_per_s", "training (trained tokens/s)"),
               ("perf/logprob_tokens_per_s", "log-prob pass (tokens/s)"),
               ("perf/step_tokens_per_s", "whole step (trained tokens/s)"))


def _throughput(p: _Plotter):
    m = p.m
    keys = [(k, label) for k, label in _THROUGHPUT if m.has(k)]
    if not keys:
        return None
    fig, (ax,) = p.figure(1, 3.8)
    for k, label in keys:
        p.line(ax, k, label, smooth=True)
    ax.set_yscale("log")  # generation runs 10-100x slower than training: one linear axis hides it
    ax.set_ylabel("tokens / s (log)")
    ax.set_title("throughput")
    twin = None
    if m.has("perf/mfu"):
        twin = (ax, ax.twinx())
        x, y = m.series("perf/mfu")
        twin[1].plot(x, _smooth(y, p.window), color="k", ls="--", lw=1.2, label="MFU (right axis)")
        twin[1].set_ylabel("MFU (fraction of peak)")
    name = p.save(fig, "throughput.png", twin, legend_below=True)
    return name, ("Tokens per second of each phase, whole-run (per device: divide by the trainer or engine count). "
                  "MFU: model FLOPs / (step time x devices x the device's peak), a fraction, not a percentage; on "
                  "CPU the peak is measured at start-up unless calibrated (the run log says which). Definitions: "
                  "docs/report_formulas.md.")


def _lr(p: _Plotter):
    m = p.m
    if not m.has("train/lr"):
        return None
    fig, (ax,) = p.figure(1, 3.4)
    p.line(ax, "train/lr", "learning rate", color="C0")
    ax.set_ylabel("LR")
    ax.set_title("learning rate and response length")
    sx, sy = m.series("schedule/decaying")
    decay = [s for s, v in zip(sx, sy) if v > 0]
    if decay:
        ax.axvspan(min(decay) - 0.5, max(decay) + 0.5, color="C3", alpha=0.08, lw=0, label="length-surge decay")
    twin = None
    x, y = m.series("rollout/response_len_mean")
    if x:
        twin = (ax, ax.twinx())
        twin[1].plot(x, _smooth(y, p.window), color="C1", lw=1.2, label="mean response length")
        bx, by = m.series("schedule/surge_threshold")
        if bx:
            twin[1].plot(bx, by, color="C3", ls=":", lw=1.2, label="surge threshold")
        twin[1].set_ylabel("tokens")
    return p.save(fig, "lr.png", twin), ("The learning rate and the mean response length (the length-surge schedule's "
                                   "input; its threshold and decay phase, shaded, when logged).")


PANELS: List[Callable] = [_rewards, _mismatch, _bounds, _routing, _time, _throughput, _lr]
_SUMMARY = ("rollout/reward_mean", "eval/reward_mean", "eval/pass@1", "reward/entropy_bits", "gain/tangent",
            "gain/slack", "gain/signal_to_slack", "logprobs/mismatch_k3", "time/step")


def _summary_rows(m: Metrics) -> str:
    rows = []
    for k in _SUMMARY:
        x, y = m.series(k)
        if x:
            rows.append(f"<tr><td>{html.escape(k)}</td><td>{y[0]:.4g}</td><td>{y[-1]:.4g}</td>"
                        f"<td>{sum(y[-10:]) / len(y[-10:]):.4g}</td><td>{max(y):.4g}</td></tr>")
    return "".join(rows)


def render(run_dir: str, out_dir: Optional[str] = None) -> str:
    """Write ``index.html`` and the PNGs; return the HTML path."""
    m = Metrics.read(run_dir)
    if not m.lines:
        raise ValueError(f"{run_dir}/metrics.jsonl is empty")
    out_dir = out_dir or os.path.join(run_dir, "report")
    os.makedirs(out_dir, exist_ok=True)
    p = _Plotter(m, out_dir)
    figures = [f for f in (panel(p) for panel in PANELS) if f is not None]
    config = ""
    if os.path.isfile(os.path.join(run_dir, "config.yaml")):
        with open(os.path.join(run_dir, "config.yaml")) as f:
            config = f"<details><summary>resolved config.yaml</summary><pre>{html.escape(f.read())}</pre></details>"
    last = m.lines[-1].get("step", 0)
    body = "\n".join(f'<figure><img src="{name}" alt="{name}"><figcaption>{html.escape(cap)}</figcaption></figure>'
                     for name, cap in figures)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>megatron-rl report: {html.escape(run_dir)}</title>
<style>body{{font-family:sans-serif;max-width:860px;margin:auto;padding:1em}}img{{max-width:100%}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}
td:first-child{{text-align:left}}figcaption{{color:#555;font-size:90%;margin-bottom:1.5em}}</style></head><body>
<h1>Run report</h1><p><code>{html.escape(os.path.abspath(run_dir))}</code>: {len(m.lines)} logged steps (last {last:g}).</p>
<table><tr><th>metric</th><th>first</th><th>last</th><th>mean of last 10 logged</th><th>max</th></tr>{_summary_rows(m)}</table>
<p><small>Mean of last 10 logged: of the last 10 values in metrics.jsonl; eval/* is logged every eval.interval
steps, so for it these are the last 10 evaluations, not the last 10 steps. Definitions of every quantity:
docs/report_formulas.md in the megatron_rl repository.</small></p>
{body}
{config}
</body></html>
"""
    path = os.path.join(out_dir, "index.html")
    with open(path, "w") as f:
        f.write(page)
    return path


