"""The benchmark's summary: median and spread of the timed steps' own metrics (no figure is recomputed with
another definition: ``perf/*`` are the run's, :mod:`megatron_rl.perf`), as ``table.md``, ``bench.json`` and
PNG plots in the run folder.

Timed steps: the run's steps after the ``warmup`` first ones, without the last (it always checkpoints).
Spread: ``(max - min) / median`` over the timed steps. Derived figures, each from the run's metrics:
``gen tokens/s per engine`` = ``perf/rollout_tokens_per_s`` / engines; ``weight sync GB/s per link`` =
the median over links of ``sync/link<r>/gb_per_s``; ``other`` = ``time/step`` minus the named phases.
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any, Dict, List, Mapping, Optional, Sequence

SUMMARISED = ("time/", "perf/", "sync/", "memory/", "train/tokens", "rollout/response_len_mean",
              "rollout/seq_len_sq_sum", "rollout/prompt_tokens", "rollout/response_tokens", "rollout/staleness_",
              "rollout/partial_frac")
PHASES = ("rollout", "reward", "engine_memory", "trainer_memory", "logprobs", "advantages", "train", "diagnostics",
          "weight_sync", "checkpoint")
# (label, key, scale, format) of the table's rows
TABLE = (
    ("step time (s)", "time/step", 1.0, "{:.3f}"),
    ("tokens/s/GPU", "perf/tokens_per_s_per_gpu", 1.0, "{:.1f}"),
    ("gen tokens/s per engine", "bench/gen_tokens_per_s_per_engine", 1.0, "{:.1f}"),
    ("rollout tokens/s/GPU", "perf/rollout_tokens_per_s_per_gpu", 1.0, "{:.1f}"),
    ("train tokens/s/GPU", "perf/train_tokens_per_s_per_gpu", 1.0, "{:.1f}"),
    ("MFU (%)", "perf/mfu", 100.0, "{:.2f}"),
    ("train MFU (%)", "perf/train_mfu", 100.0, "{:.2f}"),
    ("weight sync (s)", "sync/seconds", 1.0, "{:.3f}"),
    ("weight sync GB/s per link", "bench/sync_gb_per_s_per_link", 1.0, "{:.3f}"),
    ("trainer idle (%)", "perf/trainer_idle_frac", 100.0, "{:.1f}"),
    ("engine idle (%)", "perf/engine_idle_frac", 100.0, "{:.1f}"),
    ("peak train memory (GiB)", "bench/peak_memory_gib", 1.0, "{:.3f}"),
)


def timed_rows(rows: Sequence[Mapping[str, float]], warmup: int) -> List[Mapping[str, float]]:
    steps = sorted(rows, key=lambda m: m["step"])
    return list(steps[warmup:-1])


def derived(m: Mapping[str, float], engines: int) -> Dict[str, float]:
    out = {}
    if m.get("perf/rollout_tokens_per_s") and engines:
        out["bench/gen_tokens_per_s_per_engine"] = m["perf/rollout_tokens_per_s"] / engines
    links = [v for k, v in m.items() if k.startswith("sync/link") and k.endswith("/gb_per_s")]
    if links:
        out["bench/sync_gb_per_s_per_link"] = statistics.median(links)
    peaks = [v for k, v in m.items() if k.startswith("memory/") and (k.endswith("gpu_peak_allocated_gib")
                                                                      or k.endswith("cpu_rss_gib"))]
    gpu = [v for k, v in m.items() if k.startswith("memory/") and k.endswith("gpu_peak_allocated_gib")]
    if gpu or peaks:
        out["bench/peak_memory_gib"] = max(gpu or peaks)
    named = sum(m.get(f"time/{p}", 0.0) for p in PHASES)
    out["time/other"] = max(0.0, m.get("time/step", 0.0) - named)
    return out


def summarise(rows: Sequence[Mapping[str, float]], warmup: int, engines: int) -> Dict[str, Dict[str, float]]:
    """``{metric: {median, min, max, spread, n}}`` over the timed steps."""
    timed = timed_rows(rows, warmup)
    if not timed:
        raise ValueError(f"no timed step: the run logged {len(rows)} steps, {warmup} warm-up and the last excluded")
    keyed = [{**{k: float(v) for k, v in m.items() if k.startswith(SUMMARISED) and isinstance(v, (int, float))
                 and (k != "perf/tokens_per_s_per_gpu" or "train/tokens" in m)},  # --mode engine: no training
              **derived(m, engines)} for m in timed]
    out = {}
    for key in sorted(set().union(*keyed)):
        values = [m[key] for m in keyed if key in m]
        med = statistics.median(values)
        out[key] = {"median": med, "min": min(values), "max": max(values), "n": len(values),
                    "spread": (max(values) - min(values)) / med if med else 0.0}
    return out


def markdown(stats: Mapping[str, Mapping[str, float]], title: str) -> str:
    lines = [f"### {title}", "", "| figure | median | min | max | spread |", "|---|---:|---:|---:|---:|"]
    for label, key, scale, fmt in TABLE:
        if key in stats:
            s = stats[key]
            lines.append(f"| {label} | {fmt.format(s['median'] * scale)} | {fmt.format(s['min'] * scale)} | "
                         f"{fmt.format(s['max'] * scale)} | {100 * s['spread']:.0f}% |")
    lines += ["", "| phase | median s | share of step |", "|---|---:|---:|"]
    step = stats.get("time/step", {}).get("median", 0.0)
    for p in (*PHASES, "other"):
        key = f"time/{p}"
        if key in stats and stats[key]["median"] > 0:
            lines.append(f"| {p} | {stats[key]['median']:.3f} | {100 * stats[key]['median'] / step:.0f}% |")
    return "\n".join(lines) + "\n"


def plot_phases(rows: Sequence[Mapping[str, float]], warmup: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [{**m, **derived(m, 0)} for m in timed_rows(rows, warmup)]
    phases = [p for p in (*PHASES, "other") if any(m.get(f"time/{p}", 0.0) > 0 for m in timed)]
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(timed)
    steps = [int(m["step"]) for m in timed]
    for p in phases:
        vals = [m.get(f"time/{p}", 0.0) for m in timed]
        ax.bar(steps, vals, bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("step time by phase (timed steps)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(folder: str, rows: Sequence[Mapping[str, float]], warmup: int, engines: int,
          meta: Mapping[str, Any], title: Optional[str] = None) -> Dict[str, Any]:
    """``table.md``, ``bench.json`` and ``phases.png`` in ``folder``; returns the JSON's content."""
    stats = summarise(rows, warmup, engines)
    result = {"meta": dict(meta), "warmup": warmup, "timed_steps": [int(m["step"]) for m in timed_rows(rows, warmup)],
              "stats": stats}
    with open(os.path.join(folder, "bench.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    table = markdown(stats, title or str(meta.get("recipe", "bench")))
    with open(os.path.join(folder, "table.md"), "w") as f:
        f.write(table)
    plot_phases(rows, warmup, os.path.join(folder, "phases.png"))
    result["table"] = table
    return result
