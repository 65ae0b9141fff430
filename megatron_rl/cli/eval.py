"""``megatron-rl eval RECIPE_OR_HF_DIR [key=value ...] [--model HF_DIR] [--output FILE]``: pass@k and mean@k of a
model over eval datasets with the recipe's reward (:mod:`megatron_rl.orchestration.evaluate_model`)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="a recipe YAML, a run directory, or an HF model directory")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides, e.g. eval.k=8 eval.datasets.gsm8k.path=data/gsm8k_test.jsonl")
    p.add_argument("--model", help="evaluate this HF directory instead of the recipe's model")
    p.add_argument("--output", help="also write the metrics here (JSON)")
    p.add_argument("--step", type=int, default=0, help="the step number seeding the sampling (default 0)")


def run(args: argparse.Namespace) -> int:
    # the engines, Ray and torch load only when it runs: --help and argument errors stay instant
    from megatron_rl.orchestration.evaluate_model import main

    return main(args)
