"""``megatron-rl report RUN_DIR``: one HTML page with PNG plots of a run."""

from __future__ import annotations

import argparse
import sys

from megatron_rl.report import render


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run's output directory (metrics.jsonl, config.yaml)")
    p.add_argument("--out", help="where to write index.html and the PNGs (default RUN_DIR/report)")


def run(args: argparse.Namespace) -> int:
    try:
        path = render(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"megatron-rl report: {e}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0
