"""One bench point (run, summary, calibration) and ``--sweep``: the grid of points run one after another in this
allocation (each its own run folder ``<out>/<key=value,...>``), then the scaling table.

Scaling table: per point, step time, tokens/s/GPU, devices, throughput (tokens/s over all devices) and its
efficiency against linear scaling from the point with the fewest devices (``throughput / (base throughput x
devices / base devices)``), and the phase that grew most against that base (in seconds).
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from megatron_rl.bench import runner, summary

AfterPoint = Callable[[runner.BenchSpec, Any, Dict[str, Any]], None]

GROWN_PHASES = ("rollout", "logprobs", "train", "weight_sync", "reward", "engine_memory", "trainer_memory", "other")


def parse_grid(items: Sequence[str]) -> List[Tuple[str, List[str]]]:
    grid = []
    for item in items:
        key, sep, values = item.partition("=")
        vals = [v for v in values.split(",") if v != ""]
        if not sep or not key or not vals:
            raise ValueError(f"--sweep {item!r}: write key=v1,v2 (e.g. parallel.tp=1,2 rollout.mode=sync,async)")
        grid.append((key, vals))
    return grid


def run_point(spec: runner.BenchSpec, after: Optional[AfterPoint] = None) -> Dict[str, Any]:
    """Run one bench; writes table.md, bench.json and phases.png in its folder, then calls ``after(spec, cfg,
    result)`` (the CLI's: calibration.json)."""
    from megatron_rl.perf import run_devices

    rows, cfg, facts = runner.run(spec)
    devs = run_devices(cfg)
    meta = {"recipe": spec.recipe, "mode": spec.mode, "overrides": spec.overrides, "workload": spec.workload.describe(),
            "realised_lengths": facts, "devices": {"trainer": devs.trainer, "engine": devs.engine,
                                                   "total": devs.total, "colocated": devs.colocated},
            "model": cfg.model.hf_path}
    result = summary.write(spec.folder, rows, spec.warmup, cfg.rollout.num_engines, meta,
                           title=f"{os.path.basename(spec.recipe)} {' '.join(spec.overrides)}".strip()
                           + ("" if spec.mode == "full" else f" (--mode {spec.mode})"))
    result["devices"] = devs.total
    if after is not None:
        after(spec, cfg, result)
    return result


def point_name(values: Sequence[Tuple[str, str]]) -> str:
    return ",".join(f"{k.split('.')[-1]}={v}" for k, v in values) or "base"


def run_sweep(spec: runner.BenchSpec, grid: List[Tuple[str, List[str]]],
              after: Optional[AfterPoint] = None) -> Dict[str, Any]:
    points = []
    for combo in itertools.product(*[[(k, v) for v in vals] for k, vals in grid]):
        point = spec.with_overrides([f"{k}={v}" for k, v in combo], os.path.join(spec.folder, point_name(combo)))
        result = run_point(point, after)
        points.append({"point": dict(combo), "name": point_name(combo), "devices": result["devices"],
                       "stats": {k: v["median"] for k, v in result["stats"].items()}})
    table = scaling_table(points)
    os.makedirs(spec.folder, exist_ok=True)
    with open(os.path.join(spec.folder, "scaling.json"), "w") as f:
        json.dump({"points": points}, f, indent=2)
    with open(os.path.join(spec.folder, "scaling.md"), "w") as f:
        f.write(table)
    plot_scaling(points, os.path.join(spec.folder, "scaling.png"))
    return {"points": points, "table": table}


def scaling_rows(points: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    base = min(points, key=lambda p: (p["devices"], points.index(p)))
    b = base["stats"]
    base_tput = b.get("perf/tokens_per_s_per_gpu", 0.0) * base["devices"]
    rows = []
    for p in points:
        s = p["stats"]
        tput = s.get("perf/tokens_per_s_per_gpu", 0.0) * p["devices"]
        linear = base_tput * p["devices"] / base["devices"]
        grown = max(GROWN_PHASES, key=lambda ph: s.get(f"time/{ph}", 0.0) - b.get(f"time/{ph}", 0.0))
        delta = s.get(f"time/{grown}", 0.0) - b.get(f"time/{grown}", 0.0)
        rows.append({"name": p["name"], "devices": p["devices"], "step_s": s.get("time/step", 0.0),
                     "tokens_per_s_per_gpu": s.get("perf/tokens_per_s_per_gpu", 0.0), "throughput": tput,
                     "efficiency": tput / linear if linear else 0.0, "grown": grown if delta > 0 else "-",
                     "grown_s": max(0.0, delta)})
    return rows


def scaling_table(points: List[Dict[str, Any]]) -> str:
    lines = ["| point | devices | step s | tokens/s/GPU | tokens/s | efficiency vs linear | phase that grew (s) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in scaling_rows(points):
        grown = f"{r['grown']} (+{r['grown_s']:.3f})" if r["grown"] != "-" else "-"
        lines.append(f"| {r['name']} | {r['devices']} | {r['step_s']:.3f} | {r['tokens_per_s_per_gpu']:.1f} | "
                     f"{r['throughput']:.1f} | {100 * r['efficiency']:.0f}% | {grown} |")
    return "\n".join(lines) + "\n"


def plot_scaling(points: List[Dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = scaling_rows(points)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(range(len(rows)), [r["tokens_per_s_per_gpu"] for r in rows], color="tab:blue")
    ax.set_xticks(range(len(rows)), [f"{r['name']}\n({r['devices']} dev)" for r in rows], fontsize=7)
    ax.set_ylabel("tokens/s/GPU")
    ax.set_title("tokens/s/GPU per sweep point")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
