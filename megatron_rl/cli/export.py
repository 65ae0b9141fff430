"""``megatron-rl export CHECKPOINT_DIR OUT_DIR``: a trainer checkpoint (any TP/PP/EP) -> an HF directory."""

from __future__ import annotations

import argparse
import os
import sys



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint root (its latest checkpoint) or one iter_* directory")
    p.add_argument("out_dir", help="the HF directory to write")
    p.add_argument("--model", help="the HF directory the run started from (config + tokenizer); default: recorded")
    p.add_argument("--tokenizer", help="a tokenizer to save into OUT_DIR (default: the model directory's files)")
    p.add_argument("--step", type=int, help="export iter_<STEP> of the root instead of the latest")
    for axis in ("tp", "pp", "ep"):
        p.add_argument(f"--{axis}", type=int, default=1, help=f"{axis} of the export (under torchrun; default 1)")


def run(args: argparse.Namespace) -> int:
    # torch and Megatron load only when it runs: --help and argument errors stay instant
    from megatron_rl import parallel
    from megatron_rl.export import export_checkpoint, resolve_checkpoint

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        ckpt = resolve_checkpoint(args.checkpoint, args.step)  # before any process group: a quick error
        parallel.init_process_group()
        try:
            export_checkpoint(ckpt, args.out_dir, model_path=args.model, tokenizer=args.tokenizer,
                              layout=parallel.ParallelLayout(tp=args.tp, pp=args.pp, ep=args.ep))
        finally:
            parallel.destroy()
    except (FileNotFoundError, ValueError) as e:
        print(f"megatron-rl export: {e}", file=sys.stderr)
        return 2
    print(f"exported {ckpt} -> {args.out_dir}")
    return 0
