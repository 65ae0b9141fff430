"""``megatron-rl plan MODEL_CONFIG --gpus N --gpu H100|H200|B200|cpu [--prompt-len ..] [--response-len ..]
[--calibration calibration.json]``: the predicted step time, tokens/s/GPU and MFU of candidate layouts,
placements and modes, ranked, with the breakdown and the assumptions (``megatron_rl/plan``). ``--json`` also
writes the ranking. Exit codes: 0 done, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_config", help="an HF config.json (or a directory holding one)")
    p.add_argument("--gpus", type=int, required=True, help="devices to plan for")
    p.add_argument("--gpu", default="H100", help="H100, H200, B200 or cpu (default H100)")
    p.add_argument("--prompts", type=int, default=64, help="prompts per step (default 64)")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (default 8)")
    p.add_argument("--prompt-len", default="fixed:512", help="fixed:N | lognormal:mean=M,sigma=S,cap=C | "
                                                             "empirical:PATH.jsonl (default fixed:512)")
    p.add_argument("--response-len", default="lognormal:mean=2048,sigma=0.6,cap=8192",
                   help="as --prompt-len (default lognormal:mean=2048,sigma=0.6,cap=8192)")
    p.add_argument("--micro-batch-tokens", type=int, default=16384,
                   help="train.max_tokens_per_micro_batch: a train micro-batch's token budget (default 16384)")
    p.add_argument("--forward-micro-batch-tokens", type=int, default=0,
                   help="train.forward_max_tokens_per_micro_batch (default 0: as --micro-batch-tokens)")
    p.add_argument("--calibration", default=None, help="a calibration.json written by `megatron-rl bench`")
    p.add_argument("--dtype-bytes", type=int, default=None, help="bytes per parameter (default: 2; cpu: 4)")
    p.add_argument("--cores", type=int, default=None, help="cpu only: physical cores the processes share")
    p.add_argument("--top", type=int, default=10, help="rows to print (default 10)")
    p.add_argument("--json", default=None, help="write the ranking to this JSON file")


def run(args: argparse.Namespace) -> int:
    from megatron_rl.bench.workload import Workload
    from megatron_rl.plan import calibration, devices, planner
    from megatron_rl.plan.cost_model import Efficiency

    try:
        if args.gpus < 1:
            raise ValueError(f"--gpus={args.gpus}: plan for at least 1 device")
        if args.prompts < 1 or args.samples < 1:
            raise ValueError(f"--prompts={args.prompts} --samples={args.samples}: both must be >= 1")
        if args.micro_batch_tokens < 1 or args.forward_micro_batch_tokens < 0:
            raise ValueError(f"--micro-batch-tokens={args.micro_batch_tokens} --forward-micro-batch-tokens="
                             f"{args.forward_micro_batch_tokens}: a budget >= 1 (forward: 0 for the train one's)")
        peak = calibration.measured_peak(args.calibration, args.gpu) if args.calibration else None
        dev = devices.device(args.gpu, cores=args.cores, peak_flops=peak)
        shape = planner.load_shape(args.model_config, args.dtype_bytes or (4 if dev.name == "cpu" else 2))
        work = planner.plan_workload(args.prompts, args.samples, Workload.parse(args.prompt_len, args.response_len),
                                     args.micro_batch_tokens, args.forward_micro_batch_tokens)
        eff = calibration.load(args.calibration) if args.calibration else Efficiency()
    except ValueError as e:
        print(f"megatron-rl plan: {e}", file=sys.stderr)
        return 2
    preds = planner.rank(shape, work, dev, eff, args.gpus)
    print(planner.format_plan(preds, shape, work, dev, eff, args.gpus, args.top), end="")
    if preds:
        print(f"\nrecommended: {preds[0].layout.describe()} ({preds[0].step_s:.3f} s/step)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([p.as_dict() for p in preds], f, indent=2)
    return 0
