"""Command line: ``megatron-rl <command> ...``; one module per sub-command, each with ``add_arguments(parser)``
and ``run(args) -> exit code``.

  env.py     ``megatron-rl env``: versions, devices, optional GPU extras
  train.py   ``megatron-rl train RECIPE [key=value ...] [--dry-run]``
  eval.py    ``megatron-rl eval RECIPE_OR_HF_DIR [key=value ...]``: pass@k / mean@k over eval datasets
  export.py  ``megatron-rl export CHECKPOINT_DIR OUT_DIR``: a trainer checkpoint -> HF safetensors
  report.py  ``megatron-rl report RUN_DIR``: one HTML page of PNG plots
  slurm.py   ``megatron-rl slurm RECIPE [key=value ...]``: an sbatch script for a Ray cluster over SLURM
  bench.py   ``megatron-rl bench RECIPE [key=value ...] [--steps N] [--sweep key=v1,v2 ...]``: throughput benchmark
  plan.py    ``megatron-rl plan MODEL_CONFIG --gpus N --gpu H100``: predicted step time of candidate layouts

``python -m megatron_rl.cli`` (``__main__.py``) is the same. Only the chosen sub-command's module is imported
(``megatron-rl --help`` loads neither torch nor Ray).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from typing import List, Optional

from megatron_rl import upstream_warnings

# name -> help; the module is megatron_rl.cli.<name>
COMMANDS = {
    "env": "show versions, devices and optional GPU extras",
    "slurm": "render an sbatch script running a recipe on a Ray cluster over SLURM nodes, and submit it "
             "(or print it with --dry-run)",
    "train": "run an RL recipe: `megatron-rl train RECIPE [key=value ...] [--dry-run]`",
    "eval": "pass@k and mean@k of a model over eval datasets with the recipe's reward: "
            "`megatron-rl eval RECIPE_OR_HF_DIR [key=value ...] [--model HF_DIR]`",
    "export": "a trainer checkpoint (any TP/PP/EP) -> HF safetensors + config + tokenizer: "
              "`megatron-rl export CHECKPOINT_DIR OUT_DIR`",
    "report": "one HTML page with PNG plots of a run: `megatron-rl report RUN_DIR`",
    "bench": "throughput benchmark of a recipe on a synthetic workload, no dataset: "
             "`megatron-rl bench RECIPE [key=value ...] [--steps N] [--sweep key=v1,v2 ...]`",
    "plan": "predict step time, tokens/s/GPU and MFU of candidate layouts / placements / modes: "
            "`megatron-rl plan MODEL_CONFIG --gpus N --gpu H100|H200|B200|cpu`",
}

# a dotted key=value override: collected wherever it stands (argparse takes positionals in one run only,
# so `RECIPE --dry-run a.b=1` would otherwise leave `a.b=1` unrecognized)
OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """Every sub-command with its help; ``command``'s own arguments too (its module imported)."""
    ap = argparse.ArgumentParser(prog="megatron-rl", description="RL post-training on Megatron-Core")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, help in COMMANDS.items():
        p = sub.add_parser(name, help=help)
        if name == command:
            module = importlib.import_module(f"megatron_rl.cli.{name}")
            module.add_arguments(p)
            p.set_defaults(func=module.run)
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    upstream_warnings.install()
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args, extra = parser.parse_known_args(argv)
    if hasattr(args, "overrides"):
        args.overrides = list(args.overrides or []) + [a for a in extra if OVERRIDE.match(a)]
        extra = [a for a in extra if not OVERRIDE.match(a)]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
