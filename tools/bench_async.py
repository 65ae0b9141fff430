#!/usr/bin/env python
"""Benchmark: rollout modes side by side -- ``sync``, ``one_step``, ``async`` (max_staleness 1 and 2): a thin
wrapper of ``megatron-rl bench`` (one bench per mode and repeat, its table and JSON in ``--work``/<mode>), which
adds only the pinning of processes to cores and the side-by-side table.

Throughput (default): a long-tail workload on the tiny recipe's (random, untrained) student, disaggregated on
CPU: one trainer process (TP=1) and one embedded engine process, 8 prompts x 8 samples per step, prompts of 8
tokens, responses drawn from ``lognormal:mean=31,sigma=0.8,cap=192`` (median ~22 tokens; the longest of a
step's 64 ~4-8x its median: the engines' long tail) and generated to their drawn length. A sync step then
spends over 40 % of its time generating, as RL at scale does. The student's 64-position context is widened to 256
for this (RoPE: the weights stand). ``--response-len fixed:6`` or any bench length spec changes the workload.
The learning rate is tiny and the optional gain diagnostic off: the modes are timed on the training work itself.
Per mode (the bench's medians over the timed steps; ``--warmup`` steps, start-up and pipeline fill, untimed):
steps/s (1 / median step time), tokens/s/GPU, generated tokens/s per engine, the engine's and the trainer's idle
fractions, staleness and the sequences spanning versions.

Disaggregated means the engine and the trainer have their own device. On a CPU machine the bench emulates that
by pinning the engine server's process to one core and the trainer's to another (``--pin``, the default when the
machine has 2+ cores; every thread, the whole run, every mode alike); the driver and Ray float. ``--no-pin``
lets them share the cores, so async's overlap also makes them compete for the same cores.

Reward curves (``--curves``; not a throughput figure, so ``megatron-rl train`` itself): the tiny recipe
(imitation warm-up, then GRPO with dynamic sampling and token TIS; examples/tiny_cpu.yaml), disaggregated,
``sync`` vs ``async`` (max_staleness 1, partial): greedy eval reward every 10 steps.

  python tools/bench_async.py                 # 5 modes x 3 benches, ~8 min on 2 cores
  python tools/bench_async.py --curves        # + the reward curves (~15 min)
  python tools/bench_async.py --curves-only --curve-seeds 2   # two seeds of each mode: sync's own spread is the noise
Prints markdown tables (with the machine's load average); writes JSON to --out
(default bench_results/bench_async.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megatron_rl.metrics import read_metrics  # noqa: E402

RECIPE = str(REPO / "examples" / "tiny_cpu.yaml")
MODES = {
    "sync": ["rollout.mode=sync"],
    "one_step": ["rollout.mode=one_step"],
    "async k=1": ["rollout.mode=async", "rollout.max_staleness=1", "rollout.partial=true"],
    "async k=2": ["rollout.mode=async", "rollout.max_staleness=2", "rollout.partial=true"],
    "async k=1 (no partial)": ["rollout.mode=async", "rollout.max_staleness=1"],
}


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def run(args, cmd) -> None:
    """``python -m megatron_rl.cli CMD...`` (disaggregated), its engine and trainer pinned with ``--pin``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "megatron_rl.cli", *cmd, "rollout.placement=disaggregated"]
    proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pinner = threading.Thread(target=pin_roles, args=(proc,), daemon=True) if args.pin else None
    if pinner:
        pinner.start()
    try:
        _, stderr = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{stderr[-4000:]}")


ROLES = {"megatron_rl.rollout.embedded.server": 0, "ray::TrainerWorker": 1}  # cmdline marker -> core


def pin_roles(proc: subprocess.Popen) -> None:
    """Pin every thread of the run's engine server to core 0 and of its trainer worker to core 1, until the run
    ends (threads started later inherit the pin of the thread that starts them; the scan catches the rest)."""
    from tools.chaos_run import descendants  # the run's processes: Ray's raylet is the driver's child, workers its

    while proc.poll() is None:
        for pid, cmdline in descendants(proc.pid).items():
            core = next((c for marker, c in ROLES.items() if marker in cmdline), None)
            try:
                for tid in os.listdir(f"/proc/{pid}/task") if core is not None else ():
                    os.sched_setaffinity(int(tid), {core})
            except OSError:  # the process or thread is gone
                pass
        time.sleep(0.5)


def long_context_student(student: str, positions: int) -> str:
    """The random student with room for ``positions`` tokens (its 64 are too few for long responses). Qwen3 computes
    RoPE on the fly, so the weights stand as they are; only the config changes."""
    out = Path(student + f"_ctx{positions}")
    if not out.exists():
        shutil.copytree(student, out)
        config = json.loads((out / "config.json").read_text())
        config["max_position_embeddings"] = positions
        (out / "config.json").write_text(json.dumps(config, indent=1))
    return str(out)


def throughput(args, assets) -> dict:
    from megatron_rl.bench.workload import LengthDist

    cap = LengthDist.parse(args.response_len, "--response-len").max
    if 8 + cap > 256:
        raise SystemExit(f"--response-len {args.response_len}: at most 248 tokens (8 prompt tokens, 256 positions)")
    student = assets["student"] if 8 + cap <= 64 else long_context_student(assets["student"], 256)
    bench = ["bench", RECIPE, "prepare.kind=none", f"model.hf_path={student}", "parallel.world_size=1",
             "parallel.tp=1", f"rollout.prompts_per_step={args.prompts}", "rollout.n_samples_per_prompt=8",
             "bench.prompt_len=fixed:8", f"bench.response_len={args.response_len}",
             f"train.micro_batch_size={args.micro_batch}", "optim.lr=1e-6", "optim.schedule.min_lr=1e-7",
             "diagnostics.gain=false", "--steps", str(args.steps), "--warmup", str(args.warmup), "--no-progress"]
    runs = {name: [] for name in args.modes}
    for rep in range(args.repeat):  # modes interleaved: a load that drifts over time hits each mode alike
        for name in args.modes:
            folder = Path(args.work).resolve() / f"{name.replace(' ', '_')}_r{rep}"
            runs[name].append(dict(read(folder), load_before="-") if args.report_only
                              else measure(args, name, bench, rep))
    results = {}
    for name, reps in runs.items():
        # the median repeat (a whole run, so its columns agree); of an even count the lower middle one
        best = sorted(reps, key=lambda r: r["steps_per_s"])[(len(reps) - 1) // 2]
        results[name] = dict(best, repeats_steps_per_s=[r["steps_per_s"] for r in reps])
    return results


def measure(args, name, bench, rep) -> dict:
    """One bench of one mode (its folder ``--work``/<mode>_r<repeat>)."""
    before = load()
    out = Path(args.work).resolve() / f"{name.replace(' ', '_')}_r{rep}"  # as throughput() reads it
    run(args, [*bench, *MODES[name], "--out", str(out)])
    r = dict(read(out), load_before=before, load_after=load())
    print(f"{name} (repeat {rep}): {r['steps_per_s']:.3f} steps/s (load {before} -> {load()})", flush=True)
    return r


def read(out: Path) -> dict:
    """A bench's figures: the medians of its timed steps (``bench.json``); the sequences spanning versions are
    rare, so their mean over the timed steps (the run's ``metrics.jsonl``)."""
    bench = json.loads((out / "bench.json").read_text())
    med = {k: v["median"] for k, v in bench["stats"].items()}
    timed = [m for m in read_metrics(str(out)) if m.get("step") in set(bench["timed_steps"])]
    return dict(steps_per_s=1.0 / med["time/step"], step_s=med["time/step"], folder=str(out),
                tokens_per_s_per_gpu=med.get("perf/tokens_per_s_per_gpu", 0.0),
                gen_tokens_per_s_per_engine=med.get("bench/gen_tokens_per_s_per_engine"),  # None: no rollout phase
                engine_idle=med.get("perf/engine_idle_frac", 0.0), trainer_idle=med.get("perf/trainer_idle_frac", 0.0),
                staleness_mean=med.get("rollout/staleness_mean", 0.0),
                staleness_max=med.get("rollout/staleness_max", 0.0),
                partial_frac=sum(m.get("rollout/partial_frac", 0.0) for m in timed) / max(1, len(timed)))


def curves(args, assets) -> dict:
    common = ["prepare.kind=none", f"model.hf_path={assets['student']}", f"data.path={assets['train.jsonl']}",
              f"warmup.teacher={assets['teacher']}", f"eval.data.path={assets['eval.jsonl']}",
              f"steps={args.curve_steps}", f"warmup.steps={args.curve_steps // 4}",
              f"optim.schedule.total_steps={args.curve_steps}", "eval.interval=10", "checkpoint.interval=0"]
    out = {}
    for seed in range(args.curve_seeds):  # seeds take turns, so load drift hits both modes alike
        for mode in ("sync", "async k=1"):
            name = mode if args.curve_seeds == 1 else f"{mode} seed={seed}"
            before = load()
            start = time.perf_counter()
            out_dir = Path(args.work) / f"curve_{name.replace(' ', '_')}"
            run(args, ["train", RECIPE, f"logging.output_dir={out_dir}", "overwrite=true", "logging.progress=false",
                       "logging.tensorboard=false", "logging.print_samples=0", "checkpoint.save_hf=false", *common,
                       *MODES[mode], f"seed={seed}"])
            lines = read_metrics(str(out_dir))
            out[name] = dict(eval={m["step"]: m["eval/reward_mean"] for m in lines if "eval/reward_mean" in m},
                             reward={m["step"]: m["rollout/reward_mean"] for m in lines if "rollout/reward_mean" in m},
                             wall_s=time.perf_counter() - start, load_before=before, load_after=load())
            print(f"curve {name}: final eval {list(out[name]['eval'].values())[-1]:.3f} (load {before} -> {load()})",
                  flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per bench")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (start-up, caches, pipeline fill)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (x 8 samples)")
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--response-len", default="lognormal:mean=31,sigma=0.8,cap=192",
                    help="a bench length spec (fixed:N, lognormal:mean=M,sigma=S,cap=C, empirical:PATH)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs per mode (interleaved); the median run is reported (of an even count the lower one)")
    ap.add_argument("--report-only", action="store_true",
                    help="no runs: the table again from the benches already in --work")
    ap.add_argument("--curves", action="store_true", help="also the reward curves of sync vs async on the tiny task")
    ap.add_argument("--curves-only", action="store_true")
    ap.add_argument("--curve-steps", type=int, default=200)
    ap.add_argument("--curve-seeds", type=int, default=1,
                    help="run seeds 0..N-1 of each mode: the spread between seeds of sync is the noise to compare with")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=(os.cpu_count() or 1) >= 2,
                    help="engine server on core 0, trainer on core 1: disaggregated devices (default with 2+ cores)")
    ap.add_argument("--work", default="runs/bench_async")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", default="bench_results/bench_async.json")
    args = ap.parse_args()
    from megatron_rl.data.tiny_task import prepare_tiny_arithmetic

    assets = prepare_tiny_arithmetic(str(Path(args.work) / "assets"))
    report = {"load_start": load(), "cpus": os.cpu_count(), "args": vars(args)}
    if not args.curves_only:
        report["throughput"] = tp = throughput(args, assets)
        pinned = ("engine server pinned to core 0, trainer to core 1" if args.pin else
                  "unpinned: processes share the cores")
        base = tp.get("sync", {}).get("steps_per_s")
        print(f"\n### Workload: {args.prompts} prompts x 8 samples per step, responses {args.response_len}; "
              f"1 trainer + 1 engine process ({pinned}; load average at start {report['load_start']})\n")
        print("| mode | steps/s (median) | vs sync | each repeat | tokens/s/GPU | gen tokens/s per engine | "
              "engine idle | trainer idle | staleness mean / max | spanning seqs | load (1/5/15 min) before |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for name, r in tp.items():
            ratio = f"{r['steps_per_s'] / base:.2f}x" if base else "-"
            each = ", ".join(f"{x:.2f}" for x in r["repeats_steps_per_s"])
            gen = r["gen_tokens_per_s_per_engine"]
            print(f"| {name} | {r['steps_per_s']:.3f} | {ratio} | {each} | {r['tokens_per_s_per_gpu']:.0f} | "
                  f"{'-' if gen is None else f'{gen:.0f}'} | {r['engine_idle']:.2f} | {r['trainer_idle']:.2f} | "
                  f"{r['staleness_mean']:.2f} / {r['staleness_max']:.0f} | {r['partial_frac']:.3f} | "
                  f"{r['load_before']} |")
    if args.curves or args.curves_only:
        report["curves"] = cv = curves(args, assets)
        steps = sorted(set().union(*(c["eval"] for c in cv.values())))
        print("\n### Reward curves on the tiny task (greedy eval reward)\n")
        print("| step | " + " | ".join(steps_ := [str(s) for s in steps]) + " |")
        print("|---|" + "---|" * len(steps_))
        for name in cv:
            print(f"| {name} | " + " | ".join(f"{cv[name]['eval'].get(s, float('nan')):.2f}" for s in steps) + " |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
