"""``megatron-rl bench RECIPE [key=value ...] [--steps N --warmup K --mode full|trainer|engine] [--sweep key=v1,v2 ...]``.

Runs the recipe's model, layout, placement and rollout mode on a synthetic workload (``bench.prompt_len=``,
``bench.response_len=``: fixed:N, lognormal:mean=M,sigma=S,cap=C, empirical:PATH.jsonl; ``bench.model_config=``
an HF config for a random-weight model) and writes ``table.md``, ``bench.json``, ``phases.png`` and
``calibration.json`` (what ``megatron-rl plan --calibration`` reads) into the run folder (``--out``). With
``--sweep``, one run per grid point (sequentially, in this allocation) under ``--out``/<point>, then the
scaling table (``scaling.md``, ``scaling.json``, ``scaling.png``). Exit codes: 0 done, 2 bad input, 1 a run failed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from megatron_rl.config_io import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="the recipe to benchmark, e.g. examples/tiny_cpu.yaml")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="overrides of the run (e.g. parallel.tp=2 rollout.mode=async) and of the bench "
                        "(bench.prompt_len=fixed:16 bench.response_len=lognormal:mean=24,sigma=0.5,cap=48 "
                        "bench.model_config=path/config.json)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps first (default 3: the first steps of a run are slower while caches fill and "
                        "the run's own processes finish starting)")
    p.add_argument("--mode", default="full",
                   help="full: the whole RL step (default); trainer: log-probs + train steps on one generated batch, no "
                        "rollout or sync; engine: rollout + rewards alone, no training or sync")
    p.add_argument("--out", default=None, help="the run folder (default runs/bench/<recipe name>)")
    p.add_argument("--sweep", nargs="+", metavar="key=v1,v2", default=None,
                   help="a grid: one run per combination, e.g. --sweep parallel.tp=1,2 rollout.mode=sync,async")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--log-level", default="WARNING", help="Python logging level of the driver (default WARNING)")


def run(args: argparse.Namespace) -> int:
    from megatron_rl.bench import sweep
    from megatron_rl.bench.runner import BenchSpec
    from megatron_rl.plan.calibration import write_for_bench

    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", force=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        spec = BenchSpec.from_args(args.recipe, args.overrides, steps=args.steps, warmup=args.warmup,
                                   mode=args.mode, out=args.out, progress=not args.no_progress)
        grid = sweep.parse_grid(args.sweep) if args.sweep else None
    except (ConfigError, ValueError) as e:
        print(f"megatron-rl bench: {e}", file=sys.stderr)
        return 2
    try:
        if grid:
            result = sweep.run_sweep(spec, grid, after=write_for_bench)
            print(result["table"])
        else:
            result = sweep.run_point(spec, after=write_for_bench)
            print(result["table"])
            calib = " calibration.json" if spec.mode == "full" else ""
            print(f"outputs in {spec.folder}: table.md bench.json phases.png{calib} metrics.jsonl")
    except ConfigError as e:
        print(f"megatron-rl bench: config error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"megatron-rl bench: {e}", file=sys.stderr)
        return 2
    return 0
