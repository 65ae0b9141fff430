"""``megatron-rl slurm RECIPE [key=value ...]``: render an sbatch script running a recipe on a Ray cluster over
SLURM nodes, and submit it (or print it with ``--dry-run``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_rl.launch.slurm import SBATCH_FLAGS, config_from_args, render_sbatch, submit


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="the training recipe (YAML); its optional `slurm:` section is read here")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="passed to `megatron-rl train`; `slurm.<field>=value` ones set the SLURM config instead")
    p.add_argument("--slurm-config", metavar="YAML", help="site settings (a `slurm:` section or a plain mapping), "
                   "applied after the recipe's section")
    for name, tp in SBATCH_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=tp)
    p.add_argument("--command", metavar="CMD", help="run CMD on the Ray cluster instead of `megatron-rl train RECIPE "
                   "key=value ...` (e.g. an evaluation script); RECIPE then only provides the `slurm:` section")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script instead of submitting it")
    p.add_argument("--save", metavar="PATH", help="also write the sbatch script to PATH")


def run(args: argparse.Namespace) -> int:
    try:
        cfg, train_command = config_from_args(args)
        script = render_sbatch(cfg, train_command)
        if args.dry_run:
            if args.save:
                Path(args.save).write_text(script)
            print(script, end="")
            return 0
        job_id = submit(script, cfg, args.save)
    except (ValueError, RuntimeError) as e:  # ConfigError is a ValueError
        print(f"megatron-rl slurm: error: {e}", file=sys.stderr)
        return 2
    print(f"submitted job {job_id}: logs in {cfg.log_dir}/{cfg.job_name}-{job_id}.out")
    return 0
