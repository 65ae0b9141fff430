#!/usr/bin/env python
"""Validation of ``megatron-rl plan`` on this CPU machine: one ``bench`` run calibrates the cost model, which then
predicts the step time of the other configurations (layouts, placements, modes, response lengths, batch); each is
measured with ``bench`` too, and the table says predicted vs measured step time, the error and, per comparison
group, whether the plan's best is the measured best.

Every run: the tiny recipe's model (examples/tiny_cpu.yaml, random init), 8 prompts x 8 samples, prompts of 8
tokens, ``--warmup 5 --steps 10`` (the median of 10 timed steps after 5 untimed: a tiny run's first steps on this
machine are up to 2-3x slower, by a varying amount, while caches fill and the run's processes settle); runs
are sequential, one ``megatron-rl bench`` process each; the load average before each run is recorded (the machine
is shared: the numbers are only as good as it was quiet). A run whose ``bench.json`` exists is not run again
(``--rerun`` forces it).

  python tools/bench_plan_validation.py --out bench_results/plan_validation     # ~1 min a run on 2 cores
  python tools/bench_plan_validation.py --out bench_results/plan_validation --predict-only

Writes ``prediction_error.md`` and ``prediction_error.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
RECIPE = str(ROOT / "examples" / "tiny_cpu.yaml")
BASE = ["rollout.prompts_per_step=8", "bench.prompt_len=fixed:8"]
DISAGG = ["rollout.placement=disaggregated"]
# name -> overrides (on top of BASE); "calib" calibrates
CONFIGS: Dict[str, List[str]] = {
    "calib": ["bench.response_len=fixed:16"],
    "disagg_sync": ["bench.response_len=fixed:16", *DISAGG],
    "disagg_one_step": ["bench.response_len=fixed:16", *DISAGG, "rollout.mode=one_step"],
    "disagg_async": ["bench.response_len=fixed:16", *DISAGG, "rollout.mode=async"],
    "tp1_dp2": ["bench.response_len=fixed:16", "parallel.tp=1"],
    "ws1": ["bench.response_len=fixed:16", "parallel.tp=1", "parallel.world_size=1"],
    "ws1_disagg_sync": ["bench.response_len=fixed:16", "parallel.tp=1", "parallel.world_size=1", *DISAGG],
    "ws1_disagg_one_step": ["bench.response_len=fixed:16", "parallel.tp=1", "parallel.world_size=1", *DISAGG,
                            "rollout.mode=one_step"],
    "resp32": ["bench.response_len=fixed:32"],
    "resp8": ["bench.response_len=fixed:8"],
    "lognormal": ["bench.response_len=lognormal:mean=16,sigma=0.5,cap=40"],
    "prompts16": ["bench.response_len=fixed:16", "rollout.prompts_per_step=16"],
    "calib_repeat": ["bench.response_len=fixed:16"],  # the same again: the error the machine's noise alone makes
}
# comparison groups: does the plan pick the measured best?
GROUPS = {
    "layout (tp2 / tp1 dp2 / 1 rank)": ["calib", "tp1_dp2", "ws1"],
    "placement (colocated / disaggregated)": ["calib", "disagg_sync"],
    "mode (sync / one-step / async)": ["disagg_sync", "disagg_one_step", "disagg_async"],
    "placement, 1 trainer rank (colocated / disaggregated)": ["ws1", "ws1_disagg_sync"],
    "all layouts, placements and modes": ["calib", "tp1_dp2", "ws1", "disagg_sync", "disagg_one_step", "disagg_async",
                                          "ws1_disagg_sync", "ws1_disagg_one_step"],
    "response length (8 / 16 / 32)": ["resp8", "calib", "resp32"],
}


TIE = 0.005  # predictions this close (relative) are a tie: the plan does not order them


def load_average() -> float:
    return os.getloadavg()[0]


def matmul_rate() -> float:
    """This machine's single-thread fp32 matmul FLOP/s now (median of 5 x 0.2 s): its load, as the planner sees it."""
    import torch

    from megatron_rl.perf import measure_matmul_flops

    torch.set_num_threads(1)
    return measure_matmul_flops(torch.device("cpu"), torch.float32)


def measure(out: Path, name: str, overrides: List[str], assets: str, steps: int, warmup: int, rerun: bool,
            tries: int = 3) -> None:
    folder = out / name
    if (folder / "bench.json").exists() and not rerun:
        return
    args = [sys.executable, "-m", "megatron_rl.cli", "bench", RECIPE, f"prepare.dir={assets}",
            f"model.hf_path={assets}/student", *BASE, *overrides, "--steps", str(steps), "--warmup", str(warmup),
            "--out", str(folder), "--no-progress"]
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0", TOKENIZERS_PARALLELISM="false")
    for attempt in range(tries):  # a shared machine: Ray's memory monitor may kill a worker for a neighbour's use
        load, rate = load_average(), matmul_rate()
        proc = subprocess.run(args, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=1200)
        if proc.returncode == 0:
            break
        print(f"{name}: attempt {attempt + 1} failed, exit {proc.returncode}: {proc.stderr[-600:]}", flush=True)
    else:
        return
    with open(folder / "load.json", "w") as f:
        json.dump({"load_before": load, "load_after": load_average(), "rate_before": rate, "rate_after": matmul_rate()},
                  f)
    print(f"{name}: measured (load {load:.1f})", flush=True)


def predict(out: Path) -> Dict[str, object]:
    from megatron_rl.bench.workload import Workload
    from megatron_rl.plan import calibration, devices, planner
    from megatron_rl.plan.cost_model import predict as predict_one
    from megatron_rl.preflight import load_run_config

    calib = json.loads((out / "calib" / "calibration.json").read_text())
    dev = devices.device("cpu", peak_flops=calib["meta"]["peak_flops"])  # the calibration's peak for all

    def config(name):
        bench = json.loads((out / name / "bench.json").read_text())
        cfg = load_run_config(str(out / name / "config.yaml"), [], prepare=False, check=False)
        w = bench["meta"]["workload"]
        work = planner.workload_of(cfg, Workload.parse(w["prompt_len"], w["response_len"]))
        shape = planner.load_shape(cfg.model.hf_path, 4 if cfg.model.dtype == "float32" else 2)
        return bench, cfg, w, work, shape

    # the calibration again from the calib run's medians (what its calibration.json holds, with this cost model)
    bench, cfg, _, work, shape = config("calib")
    eff = calibration.calibrate({k: v["median"] for k, v in bench["stats"].items()}, shape, work,
                                planner.layout_of(cfg), dev)
    rate = {}  # the machine's single-thread matmul rate around each run (mean of before and after): its load
    for name in CONFIGS:
        path = out / name / "load.json"
        info = json.loads(path.read_text()) if path.exists() else {}
        rate[name] = 0.5 * (info["rate_before"] + info["rate_after"]) if "rate_before" in info else float("nan")
    rows = []
    for name in CONFIGS:
        if not (out / name / "bench.json").exists():
            print(f"{name}: not measured (its runs failed): left out", flush=True)
            continue
        bench, cfg, w, work, shape = config(name)
        pred = predict_one(shape, work, planner.layout_of(cfg), dev, eff)
        measured = bench["stats"]["time/step"]
        load = json.loads((out / name / "load.json").read_text())["load_before"] if (out / name / "load.json").exists() \
            else float("nan")
        rows.append({"name": name, "layout": planner.layout_of(cfg).describe(), "workload": w, "rate": rate[name],
                     "predicted_s": pred.step_s, "measured_s": measured["median"], "measured_min_s": measured["min"],
                     "measured_max_s": measured["max"], "error": pred.step_s / measured["median"] - 1.0,
                     "load": load})
    by = {r["name"]: r for r in rows}
    groups = []
    for g, names in GROUPS.items():
        if any(n not in by for n in names):
            continue
        best_measured = min(names, key=lambda n: by[n]["measured_s"])
        by_pred = sorted(names, key=lambda n: by[n]["predicted_s"])
        best_pred = by[best_measured]["predicted_s"]
        ahead = [n for n in names if by[n]["predicted_s"] < best_pred * (1 - TIE)]
        tied = [n for n in names if n != best_measured and abs(by[n]["predicted_s"] / best_pred - 1) <= TIE]
        groups.append({"group": g, "measured_best": best_measured, "predicted_order": by_pred,
                       "rank_of_best": len(ahead) + 1, "tied_with": tied})
    return {"rows": rows, "groups": groups, "efficiency": dataclasses.asdict(eff)}


def markdown(res: Dict[str, object]) -> str:
    rows, groups = res["rows"], res["groups"]
    lines = ["| config | layout | response | predicted s | measured s (min-max) | error | load | matmul GFLOP/s |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['layout']} | {r['workload']['response_len']} | {r['predicted_s']:.3f} | "
                     f"{r['measured_s']:.3f} ({r['measured_min_s']:.3f}-{r['measured_max_s']:.3f}) | "
                     f"{100 * r['error']:+.0f}% | {r['load']:.1f} | {r['rate'] / 1e9:.1f} |")
    others = [r for r in rows if r["name"] != "calib"]
    within = sum(abs(r["error"]) <= 0.25 for r in others)
    lines += ["", f"{within} of {len(others)} predictions within ±25 % (median |error| "
                  f"{100 * statistics.median(abs(r['error']) for r in others):.0f}%); calib is the calibration run.",
              "", "| comparison | measured best | plan's order | rank of the measured best |", "|---|---|---|---:|"]
    for g in groups:
        tie = f" (tied with {', '.join(g['tied_with'])})" if g["tied_with"] else ""
        lines.append(f"| {g['group']} | {g['measured_best']} | {' < '.join(g['predicted_order'])} | "
                     f"{g['rank_of_best']}{tie} |")
    first = sum(g["rank_of_best"] == 1 and not g["tied_with"] for g in groups)
    tied = sum(g["rank_of_best"] == 1 and bool(g["tied_with"]) for g in groups)
    lines += ["", f"the plan ranks the measured best first in {first} of {len(groups)} comparisons"
              + (f", and first within a predicted tie in {tied} more" if tied else "")]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_results/plan_validation")
    ap.add_argument("--assets", default="runs/tiny_assets", help="the tiny recipe's assets (made if missing)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--only", nargs="*", default=None, help="measure only these configs")
    ap.add_argument("--rerun", action="store_true")
    ap.add_argument("--predict-only", action="store_true")
    a = ap.parse_args()
    out = Path(a.out).resolve()
    if not a.predict_only:
        for name, overrides in CONFIGS.items():
            if a.only is None or name in a.only:
                measure(out, name, overrides, str(Path(a.assets).resolve()), a.steps, a.warmup, a.rerun)
    res = predict(out)
    table = markdown(res)
    (out / "prediction_error.md").write_text(table)
    (out / "prediction_error.json").write_text(json.dumps(res, indent=2))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
