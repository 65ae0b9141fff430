"""Command line: ``megatron-rl <command> ...``."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import platform
import sys
from typing import List, Optional


def _cmd_env(_args: argparse.Namespace) -> int:
    """Print what this machine offers: versions, devices, optional GPU extras. Versions come from the installed
    distributions' metadata, not by importing them (importing Megatron-Core, Ray and SGLang took ~10 s)."""
    from importlib import metadata

    import torch

    print(f"python            {platform.python_version()}")
    print(f"torch             {torch.__version__} (cuda available: {torch.cuda.is_available()})")
    if torch.cuda.is_available():
        print(f"gpus              {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    for mod, dists in (("megatron.core", ("megatron-core",)), ("transformers", ("transformers",)), ("ray", ("ray",)),
                       ("datasets", ("datasets",)), ("safetensors", ("safetensors",)),
                       ("transformer_engine", ("transformer-engine", "transformer_engine")), ("sglang", ("sglang",))):
        version = None
        for dist in dists:
            try:
                version = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
        if version is None and importlib.util.find_spec(mod.split(".")[0]) is not None:
            version = "installed"  # importable without distribution metadata (a source checkout on the path)
        print(f"{mod:<17} {version or 'not available'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megatron-rl", description="RL post-training on Megatron-Core")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("env", help="show versions, devices and optional GPU extras")
    p.set_defaults(func=_cmd_env)
    from megatron_rl.launch import slurm  # stdlib + yaml only: cheap to import

    p = sub.add_parser("slurm", help="render an sbatch script running a recipe on a Ray cluster over SLURM "
                       "nodes, and submit it (or print it with --dry-run)")
    slurm.add_arguments(p)
    p.set_defaults(func=slurm.cli_main)
    from megatron_rl.orchestration import cli as train_cli  # argparse only: Ray and torch load when it runs

    p = sub.add_parser("train", help="run an RL recipe: `megatron-rl train RECIPE [key=value ...] [--dry-run]`")
    train_cli.add_arguments(p)
    p.set_defaults(func=train_cli.cli_main)
    from megatron_rl.orchestration import eval_cli

    p = sub.add_parser("eval", help="pass@k and mean@k of a model over eval datasets with the recipe's reward: "
                       "`megatron-rl eval RECIPE_OR_HF_DIR [key=value ...] [--model HF_DIR]`")
    eval_cli.add_arguments(p)
    p.set_defaults(func=eval_cli.cli_main)
    from megatron_rl import export, report  # argparse only: torch / matplotlib load when they run

    p = sub.add_parser("export", help="a trainer checkpoint (any TP/PP/EP) -> HF safetensors + config + tokenizer: "
                       "`megatron-rl export CHECKPOINT_DIR OUT_DIR`")
    export.add_arguments(p)
    p.set_defaults(func=export.cli_main)
    p = sub.add_parser("report", help="one HTML page with PNG plots of a run: `megatron-rl report RUN_DIR`")
    report.add_arguments(p)
    p.set_defaults(func=report.cli_main)
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    from megatron_rl import upstream_warnings

    upstream_warnings.install()
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
