#!/usr/bin/env python
"""Benchmark: tokens/s of one RL train step (PPO loss) with our trainer vs a plain HF-transformers step.

Model: Qwen3 architecture, 4 layers, hidden 256 (4 heads x 64, 2 KV heads), FFN 768, random weights.
Batch: 16 sequences x 256 tokens (64 prompt + 192 response), 4 micro-batches of 4 sequences.

Rows (each in fresh processes, 2 CPU threads in total):
  ours TP=1      PolicyTrainer.train_step, 1 process x 2 threads (Megatron schedule, DDP, distributed Adam;
                 "plain Adam": the non-distributed Megatron optimizer)
  ours TP=2      the same on 2 gloo processes x 1 thread (tensor + sequence parallel)
  ..., unfused head   train.fused_head=false: statistics from materialised logits (the default fused head
                 computes them from the output layer's input, response positions only)
  HF + PG loss   transformers Qwen3ForCausalLM, 1 process x 2 threads, torch AdamW, the same objective
                 (megatron_rl.ops / objectives on the unsharded logits) with gradient accumulation
  HF + CE        the same HF step with plain cross-entropy on the response tokens
"fwd" is the forward-only log-prob pass (PolicyTrainer.forward / HF under no_grad) of the same batch.

  python tools/bench_train.py                 # vocab 8192, 3 timed steps after 1 warm-up
  python tools/bench_train.py --vocab 32000 --steps 5
  python tools/bench_train.py --vocab 152064 --rows "ours TP=1"    # rows whose name starts with this
Writes a markdown table to stdout and JSON to --out (default bench_results/bench_train.json).
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

from megatron_rl.testing import run_distributed, tiny_hf_checkpoint  # noqa: E402

BATCH, PROMPT, RESPONSE, MICRO = 16, 64, 192, 4
MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             intermediate_size=768, max_position_embeddings=512)


def _batch(vocab: int):
    from megatron_rl.training import TrainBatch

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (PROMPT,), generator=g) for _ in range(BATCH)]
    responses = [torch.randint(0, vocab, (RESPONSE,), generator=g) for _ in range(BATCH)]
    batch = TrainBatch.from_sequences(prompts, responses, advantages=[float(i % 3 - 1) for i in range(BATCH)])
    lp = -torch.rand(BATCH, RESPONSE, generator=g) * 3 - 5
    return batch.replace(rollout_logprobs=lp, old_logprobs=lp + 0.01)


def _timed(fn, steps: int):
    fn()  # warm-up (allocations, lazy inits)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _ours(path: str, tp: int, vocab: int, steps: int, dist_opt: bool = True, fused_head: bool = True):
    import torch.distributed as dist

    from megatron_rl import parallel
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.training import OptimConfig, PolicyTrainer, TrainConfig

    groups = parallel.init_megatron_parallel(parallel.ParallelLayout(tp=tp))
    trainer = PolicyTrainer(ModelConfig(hf_path=path), TrainConfig(micro_batch_size=MICRO, fused_head=fused_head),
                            groups,
                            OptimConfig(lr=1e-5, use_distributed_optimizer=dist_opt))
    batch = _batch(vocab)
    train = _timed(lambda: trainer.train_step(batch), steps)
    fwd = _timed(lambda: trainer.forward(batch), steps)
    dist.barrier()
    return {"train_s": train, "fwd_s": fwd}


def _hf(path: str, vocab: int, steps: int, loss: str):
    from transformers import AutoModelForCausalLM

    from megatron_rl.objectives import ObjectiveConfig, ReduceGroups, rl_loss, step_normalizer
    from megatron_rl.training import TrainConfig, loss_glue, make_micro_batches

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    batch = _batch(vocab)
    cfg = TrainConfig(micro_batch_size=MICRO, objective=ObjectiveConfig())
    mbs = make_micro_batches(batch, MICRO, group_by_length=False)

    def step():
        opt.zero_grad(set_to_none=True)
        norm = step_normalizer([loss_glue.normalizer_inputs(mb, cfg) for mb in mbs], cfg.objective)
        for mb in mbs:
            logits = model(mb.input_ids).logits
            if loss == "pg":
                stats = loss_glue.token_stats(logits, mb, cfg, tp_group=None, vocab_size=vocab)
                value, _ = rl_loss(loss_glue.loss_inputs(stats, mb), cfg.objective, ReduceGroups(), norm)
            else:
                rows = logits.gather(1, mb.logit_index[..., None].expand(-1, -1, logits.shape[-1]))
                tgt = mb.targets.gather(1, mb.logit_index)
                value = torch.nn.functional.cross_entropy(rows.flatten(0, 1), tgt.flatten()) / len(mbs)
            value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    def forward():
        with torch.no_grad():
            for mb in mbs:
                logits = model(mb.input_ids).logits
                loss_glue.token_stats(logits, mb, cfg, tp_group=None, vocab_size=vocab)

    return {"train_s": _timed(step, steps), "fwd_s": _timed(forward, steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3, help="timed steps (median reported) after one warm-up")
    ap.add_argument("--rows", default="", help="comma list: run only rows whose name starts with one of these")
    ap.add_argument("--out", default="bench_results/bench_train.json")
    args = ap.parse_args()
    tokens = BATCH * (PROMPT + RESPONSE)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_hf_checkpoint(os.path.join(tmp, "qwen3"), "qwen3", vocab_size=args.vocab, **MODEL)
        runs = [
            ("ours TP=1", "1 proc x 2 threads", lambda: run_distributed(_ours, 1, path, 1, args.vocab, args.steps,
                                                                         threads_per_rank=2, timeout_s=1800)),
            ("ours TP=1, plain Adam", "1 proc x 2 threads", lambda: run_distributed(
                _ours, 1, path, 1, args.vocab, args.steps, False, threads_per_rank=2, timeout_s=1800)),
            ("ours TP=2", "2 procs x 1 thread", lambda: run_distributed(_ours, 2, path, 2, args.vocab, args.steps,
                                                                         threads_per_rank=1, timeout_s=1800)),
            ("ours TP=1, unfused head", "1 proc x 2 threads", lambda: run_distributed(
                _ours, 1, path, 1, args.vocab, args.steps, True, False, threads_per_rank=2, timeout_s=1800)),
            ("ours TP=2, unfused head", "2 procs x 1 thread", lambda: run_distributed(
                _ours, 2, path, 2, args.vocab, args.steps, True, False, threads_per_rank=1, timeout_s=1800)),
            ("HF + PG loss", "1 proc x 2 threads", lambda: run_distributed(_hf, 1, path, args.vocab, args.steps, "pg",
                                                                            threads_per_rank=2, timeout_s=1800)),
            ("HF + CE", "1 proc x 2 threads", lambda: run_distributed(_hf, 1, path, args.vocab, args.steps, "ce",
                                                                       threads_per_rank=2, timeout_s=1800)),
        ]
        wanted = [w.strip() for w in args.rows.split(",") if w.strip()]
        for name, procs, run in runs:
            if wanted and not any(name.startswith(w) for w in wanted):
                continue
            r = run()[0]
            rows.append({"name": name, "procs": procs, **r, "train_tokens_per_s": tokens / r["train_s"],
                         "fwd_tokens_per_s": tokens / r["fwd_s"]})
            print(f"  {name}: {r}", file=sys.stderr, flush=True)
    print(f"\nQwen3 4x256 (FFN 768), vocab {args.vocab}, {BATCH} x {PROMPT + RESPONSE} tokens, "
          f"micro-batch {MICRO}, fp32, {os.cpu_count()} cores\n")
    print("| run | processes | train step (s) | train tokens/s | fwd log-probs (s) | fwd tokens/s |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['name']} | {r['procs']} | {r['train_s']:.2f} | {r['train_tokens_per_s']:.0f} | "
              f"{r['fwd_s']:.2f} | {r['fwd_tokens_per_s']:.0f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"vocab": args.vocab, "batch": BATCH, "seq": PROMPT + RESPONSE, "micro_batch": MICRO,
                               "model": MODEL, "cores": os.cpu_count(), "torch": torch.__version__, "rows": rows},
                              indent=2))


if __name__ == "__main__":
    main()
