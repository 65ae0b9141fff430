#!/usr/bin/env python
"""Trainer throughput rows of the prepared GPU check (issue 23): tokens/s, MFU and peak memory of one
PolicyTrainer.train_step on Qwen3-shaped random models, bf16, local layer spec unless TE is importable,
distributed optimizer, packed micro-batches under a 16 384-token budget.

Workload (the issue's): 64 sequences, a 256-token prompt and a lognormal response (sigma 1.0) scaled so the
longest is 4096 tokens. MFU: model FLOPs (6 x parameters x tokens, plus causal attention
6 x 2 x layers x q_heads x head_dim x sum(L_i^2) / 2 ... fwd+bwd) over the step time and --peak-tflops (989:
H100/H200 dense bf16). Each shape runs in its own process (clean memory); an out-of-memory is a row too.

  python tools/gpu_throughput.py                   # 0.6B, 1.7B, 4B on the GPU; JSON to $OUT or bench_results/
  python tools/gpu_throughput.py --shapes 0.6B --steps 2
  python tools/gpu_throughput.py --cpu             # a tiny shape on CPU, float32, gloo (checks the script runs)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # multiproc: the multi-process launcher

from multiproc import run_distributed  # noqa: E402

VOCAB = 151936
SHAPES = {  # Qwen3 configs: hidden, layers, q heads, kv heads, head_dim, FFN
    "0.6B": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=VOCAB, tie_word_embeddings=True),
    "1.7B": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=6144, vocab_size=VOCAB, tie_word_embeddings=True),
    "4B": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, intermediate_size=9728, vocab_size=VOCAB, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=96, vocab_size=250, tie_word_embeddings=False),
}
WORKLOAD = dict(n=64, prompt=256, longest=4096, sigma=1.0, budget=16384)
CPU_WORKLOAD = dict(n=8, prompt=8, longest=48, sigma=1.0, budget=256)


def _config(path: str, shape: dict, max_pos: int) -> str:
    import transformers

    transformers.Qwen3Config(**shape, max_position_embeddings=max_pos, rope_theta=1e6, rms_norm_eps=1e-6,
                             torch_dtype="bfloat16").save_pretrained(path)
    return path


def _batch(w: dict, vocab: int):
    from megatron_rl.training import TrainBatch

    g = torch.Generator().manual_seed(0)
    n = w["n"]
    z = torch.distributions.Normal(0.0, 1.0).icdf((torch.arange(n) + 0.5) / n)
    lengths = torch.exp(w["sigma"] * z)
    lengths = (lengths / lengths.max() * (w["longest"] - w["prompt"])).round().clamp(min=1).long()
    prompts = [torch.randint(0, vocab, (w["prompt"],), generator=g) for _ in range(n)]
    responses = [torch.randint(0, vocab, (int(k),), generator=g) for k in lengths]
    batch = TrainBatch.from_sequences(prompts, responses, advantages=torch.randn(n, generator=g).tolist())
    lp = -torch.rand(batch.response_mask.shape, generator=g) * 3 - 1
    return batch.replace(rollout_logprobs=lp, old_logprobs=lp + 0.01)


def _flops(shape: dict, params: int, lengths: torch.Tensor) -> float:
    attn = 2 * 2 * shape["num_hidden_layers"] * shape["num_attention_heads"] * shape["head_dim"]
    return 6.0 * params * float(lengths.sum()) + 3.0 * attn * float((lengths.double() ** 2).sum()) / 2


def _worker(path: str, name: str, w: dict, steps: int, cpu: bool, peak_tflops: float):
    from megatron_rl import parallel
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.training import OptimConfig, PolicyTrainer, TrainConfig

    row = {"shape": name}
    try:
        groups = parallel.init_megatron_parallel(parallel.ParallelLayout())
        model = ModelConfig(hf_path=path, dtype="float32" if cpu else "bfloat16")
        train = TrainConfig(max_tokens_per_micro_batch=w["budget"], forward_max_tokens_per_micro_batch=w["budget"])
        trainer = PolicyTrainer(model, train, groups, OptimConfig(lr=1e-6), load_weights=False)
        batch = _batch(w, SHAPES[name]["vocab_size"])
        params = sum(p.numel() for p in trainer.module.parameters())
        trainer.train_step(batch)  # warm-up
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            result = trainer.train_step(batch)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        step = statistics.median(times)
        tokens = int(batch.seq_lengths.sum())
        flops = _flops(SHAPES[name], params, batch.seq_lengths)
        row.update(params=params, tokens=tokens, step_s=step, tokens_per_s=tokens / step,
                   mfu=flops / step / (peak_tflops * 1e12), skipped=bool(result.skipped),
                   micro_batches=result.metrics.get("batch/micro_batches"),
                   mean_over_max_response=float(batch.response_lengths.float().mean() / batch.response_lengths.max()),
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None)
    except torch.cuda.OutOfMemoryError as e:
        row["error"] = f"out of memory: {str(e).splitlines()[0]}"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="tiny shape on CPU (the script runs; no figures)")
    ap.add_argument("--shapes", nargs="+", default=None)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--timeout-s", type=float, default=240.0, help="per shape")
    args = ap.parse_args()
    cpu = args.cpu or not torch.cuda.is_available()
    shapes = args.shapes or (["tiny"] if cpu else ["0.6B", "1.7B", "4B"])
    w = CPU_WORKLOAD if cpu else WORKLOAD
    rows = []
    for name in shapes:
        if name not in SHAPES:
            raise SystemExit(f"--shapes {name}: expected one of {sorted(SHAPES)}")
        with tempfile.TemporaryDirectory() as tmp:
            path = _config(tmp, SHAPES[name], max(256, w["longest"]))
            try:
                rows += run_distributed(_worker, 1, path, name, w, args.steps, cpu, args.peak_tflops,
                                        timeout_s=args.timeout_s, backend="gloo" if cpu else "nccl")
            except Exception as e:  # noqa: BLE001 - one shape's failure is its row; the others still run
                rows.append({"shape": name, "error": str(e).strip().splitlines()[-1][:300]})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n| shape | step | tokens/s | MFU ({args.peak_tflops:.0f} TF/s peak) | peak memory |\n|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['error']} | | | |")
        else:
            mem = f"{r['peak_gib']:.1f} GiB" if r.get("peak_gib") is not None else "n/a (CPU)"
            print(f"| {r['shape']} | {r['step_s']:.2f} s | {r['tokens_per_s'] / 1e3:.1f} k | {r['mfu']:.1%} | {mem} |")
    out = Path(os.environ.get("OUT") or "bench_results") / ("gpu_throughput_cpu.json" if cpu else "gpu_throughput.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": "cpu" if cpu else torch.cuda.get_device_name(), "workload": w,
                               "rows": rows}, indent=1))
    print(f"wrote {out}")
    if any("error" in r for r in rows) and cpu:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
