#!/usr/bin/env python
"""Benchmark: tokens/s of one RL train step (PPO loss): our trainer vs plain HF, and padded vs packed
micro-batches on RL's long-tailed lengths.

Model: Qwen3 architecture, 4 layers, hidden 256 (4 heads x 64, 2 KV heads), FFN 768, random weights.

Suite ``uniform`` — 16 sequences x 256 tokens (64 prompt + 192 response), 4 micro-batches of 4:
  ours TP=1      PolicyTrainer.train_step, 1 process x 2 threads (Megatron schedule, DDP, distributed Adam;
                 "plain Adam": the non-distributed Megatron optimizer)
  ours TP=2      the same on 2 gloo processes x 1 thread (tensor + sequence parallel)
  ..., unfused head   train.fused_head=false: statistics from materialised logits (the default fused head
                 computes them from the output layer's input, response positions only)
  HF + PG loss   transformers Qwen3ForCausalLM, 1 process x 2 threads, torch AdamW, the same objective
                 (megatron_rl.ops / objectives on the unsharded logits) with gradient accumulation
  HF + CE        the same HF step with plain cross-entropy on the response tokens
"fwd" is the forward-only log-prob pass (PolicyTrainer.forward / HF under no_grad) of the same batch.

Suite ``packing`` — 32 sequences: 32 prompt tokens + a lognormal response (sigma 0.8, longest 480: mean/max
of the responses ~0.25, as RL produces), at TP=1 (1 process x 2 threads) and TP=2 (2 x 1):
  padded         4 sequences per micro-batch, each padded to its longest, in arrival order
  padded, sorted the same, sorted by length first (train.group_by_length, the padded default)
  packed         4 sequences per micro-batch in one [1, T] stream (train.packing)
  packed+budget  packed under train.max_tokens_per_micro_batch=2048 (forward: 4096), work balanced
plus the portable attention's other packed implementation (one block-diagonal mask over the stream) and a
batch whose longest sequence (1000 tokens) exceeds a 512-token budget: an error at CP=1, trained at CP=2
(2 processes x 1 thread, each holding half of every sequence).

Suite ``tiny`` — the tiny recipe's model and batch shape (512 sequences of 5-10 tokens, TP=2): padded
(its old setting) vs packed vs packed under a token budget, which decides examples/tiny_cpu.yaml.

The cases of one layout share their processes and take turns step by step (on a shared machine the load
drifts between sequential runs; in turns it hits every case alike). Tokens/s count real tokens only. Peak
memory: the processes' resident-set high-water mark during the case's train step (reset before it; CUDA:
peak allocation), max over ranks; it includes the other cases' idle models.

  python tools/bench_train.py                  # every suite, vocab 8192, median of 3 steps after a warm-up
  python tools/bench_train.py --suite packing --steps 2
  python tools/bench_train.py --suite uniform --vocab 152064 --rows "ours TP=1"   # rows whose name starts with it
Writes markdown tables to stdout and JSON to --out (default bench_results/bench_train.json).
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

from multiproc import run_distributed, tiny_hf_checkpoint  # noqa: E402

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
                rows = logits.reshape(-1, logits.shape[-1])[mb.logit_index]  # [b, r, V] at the response tokens
                tgt = mb.targets.reshape(-1)[mb.logit_index]
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


def _longtail_batch(vocab: int, n: int = 32, prompt: int = 32, longest: int = 480, sigma: float = 0.8,
                    giant: int = 0):
    """Responses at the lognormal's quantiles scaled so the longest is ``longest``, shuffled (arrival
    order); ``giant``: the first response replaced by one of that many tokens."""
    from megatron_rl.training import TrainBatch

    g = torch.Generator().manual_seed(0)
    z = torch.distributions.Normal(0.0, 1.0).icdf((torch.arange(n) + 0.5) / n)
    lengths = torch.exp(sigma * z)
    lengths = (lengths / lengths.max() * longest).round().clamp(min=1).long()[torch.randperm(n, generator=g)]
    if giant:
        lengths[0] = giant - prompt
    prompts = [torch.randint(0, vocab, (prompt,), generator=g) for _ in range(n)]
    responses = [torch.randint(0, vocab, (int(k),), generator=g) for k in lengths]
    batch = TrainBatch.from_sequences(prompts, responses, advantages=torch.randn(n, generator=g).tolist())
    B, R = batch.response_mask.shape
    lp = -torch.rand(B, R, generator=g) * 3 - 5
    return batch.replace(rollout_logprobs=lp, old_logprobs=lp + 0.01)


def _tiny_batch(vocab: int, n: int = 512):
    """The tiny recipe's shape: 512 sequences of a 4-6 token prompt and a 1-4 token response."""
    from megatron_rl.training import TrainBatch

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (int(k),), generator=g) for k in torch.randint(4, 7, (n,), generator=g)]
    responses = [torch.randint(3, vocab, (int(k),), generator=g) for k in torch.randint(1, 5, (n,), generator=g)]
    batch = TrainBatch.from_sequences(prompts, responses, advantages=torch.randn(n, generator=g).tolist())
    lp = -torch.rand(batch.response_mask.shape, generator=g) * 3 - 1
    return batch.replace(rollout_logprobs=lp, old_logprobs=lp + 0.01)


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    else:  # Linux: reset the process's resident-set high-water mark (VmHWM)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def _peak_mib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024  # kB


def _interleaved(path: str, layout: dict, steps: int, cases: list, batch_kind: str, batch_kwargs: dict) -> list:
    """Each case's trainer built in the same processes, their steps taken in turns (1, 2, 3, 1, 2, 3, ...):
    on a shared machine the load drifts between sequential runs, in turns it hits every case alike. Peak
    memory: the processes' peak resident set (CUDA: peak allocation) during that case's train step, max
    over ranks (it includes the other cases' idle models and optimizer state)."""
    import torch.distributed as dist

    from megatron_rl import parallel
    from megatron_rl.models import attention
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.training import OptimConfig, PolicyTrainer, TrainConfig

    groups = parallel.init_megatron_parallel(parallel.ParallelLayout(**layout))
    batch = {"longtail": _longtail_batch, "tiny": _tiny_batch}[batch_kind](**batch_kwargs)
    trainers = [PolicyTrainer(ModelConfig(hf_path=path), TrainConfig(**train), groups, OptimConfig(lr=1e-5))
                for _, train, _ in cases]
    out = [{"train": [], "fwd": [], "peak": 0.0} for _ in cases]
    for i in range(steps + 1):  # round 0 warms up
        for (_, _, impl), trainer, rec in zip(cases, trainers, out):
            if "error" in rec:
                continue
            attention.PACKED_IMPL = impl
            _reset_peak()
            t = time.perf_counter()
            try:
                result = trainer.train_step(batch)
            except ValueError as e:
                rec["error"] = str(e)
                continue
            elapsed = time.perf_counter() - t
            rec["peak"] = max(rec["peak"], _peak_mib())
            t = time.perf_counter()
            trainer.forward(batch)
            if i:
                rec["train"].append(elapsed)
                rec["fwd"].append(time.perf_counter() - t)
            rec["metrics"] = result.metrics
    attention.PACKED_IMPL = "auto"
    peaks = torch.tensor([rec["peak"] for rec in out], dtype=torch.float64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    info = {"real_tokens": int(batch.seq_lengths.sum()), "longest": int(batch.seq_lengths.max()),
            "mean_over_max_response": float(batch.response_lengths.float().mean() / batch.response_lengths.max())}
    rows = []
    for rec, peak in zip(out, peaks.tolist()):
        if "error" in rec:
            rows.append({"error": rec["error"]})
            continue
        m = rec["metrics"]
        rows.append({"train_s": statistics.median(rec["train"]), "fwd_s": statistics.median(rec["fwd"]),
                     "peak_mib": peak, "padding_frac": m["batch/padding_frac"],
                     "micro_batches": m["batch/micro_batches"], **info})
    return rows


PACKING_CASES = [  # name, train config, packed attention implementation
    ("padded", dict(packing=False, micro_batch_size=4, group_by_length=False), "auto"),
    ("padded, sorted", dict(packing=False, micro_batch_size=4), "auto"),
    ("packed", dict(micro_batch_size=4), "auto"),
    ("packed+budget", dict(max_tokens_per_micro_batch=2048, forward_max_tokens_per_micro_batch=4096), "auto"),
]
BLOCK_DIAGONAL = ("packed+budget, block-diagonal attention", PACKING_CASES[-1][1], "block_diagonal")
BUDGET_512 = ("longest 1000 > budget 512",
              dict(max_tokens_per_micro_batch=512, forward_max_tokens_per_micro_batch=512), "auto")


def _suite(path: str, steps: int, runs: list) -> list:
    rows = []
    for layout, cases, batch_kind, batch_kwargs in runs:
        n = layout.get("tp", 1) * layout.get("cp", 1)
        procs = "1 proc x 2 threads" if n == 1 else f"{n} procs x 1 thread"
        tag = ", ".join(f"{k.upper()}={v}" for k, v in layout.items()) or "TP=1"
        results = run_distributed(_interleaved, n, path, layout, steps, cases, batch_kind, batch_kwargs,
                                  threads_per_rank=2 // n, timeout_s=3600)[0]
        for (name, _, _), r in zip(cases, results):
            rows.append({"name": f"{name}, {tag}", "procs": procs, **r})
            print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def _packing_suite(path: str, vocab: int, steps: int) -> list:
    long, giant = {"vocab": vocab}, {"vocab": vocab, "giant": 1000}
    return _suite(path, steps, [({}, PACKING_CASES + [BLOCK_DIAGONAL], "longtail", long),
                                ({"tp": 2}, PACKING_CASES, "longtail", long),
                                ({}, [BUDGET_512], "longtail", giant),
                                ({"cp": 2}, [BUDGET_512], "longtail", giant)])


TINY_CASES = [  # the tiny recipe at TP=2: micro_batch_size 64 of its 512 sequences per step
    ("padded, sorted", dict(packing=False, micro_batch_size=64), "auto"),
    ("packed", dict(micro_batch_size=64), "auto"),
    ("packed+budget", dict(max_tokens_per_micro_batch=1024, forward_max_tokens_per_micro_batch=4096), "auto"),
]


def _tiny_suite(path: str, steps: int) -> list:
    return _suite(path, steps, [({"tp": 2}, TINY_CASES, "tiny", {"vocab": 64})])


def _print_packing(rows: list, title: str) -> None:
    print(f"\n{title}, fp32, {os.cpu_count()} cores\n")
    print("| run | processes | micro-batches | padding | train step (s) | train real tokens/s | fwd real tokens/s "
          "| peak memory (MiB) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | {r['procs']} | — | — | error: {r['error'].split(';')[0]} | — | — | — |")
            continue
        print(f"| {r['name']} | {r['procs']} | {r['micro_batches']:.0f} | {r['padding_frac']:.0%} | {r['train_s']:.2f} "
              f"| {r['real_tokens'] / r['train_s']:.0f} | {r['real_tokens'] / r['fwd_s']:.0f} | {r['peak_mib']:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3, help="timed steps (median reported) after one warm-up")
    ap.add_argument("--suite", choices=("uniform", "packing", "tiny", "all"), default="all")
    ap.add_argument("--rows", default="", help="uniform suite: comma list, only rows whose name starts with one")
    ap.add_argument("--out", default="bench_results/bench_train.json")
    args = ap.parse_args()
    result = {"vocab": args.vocab, "model": MODEL, "cores": os.cpu_count(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        if args.suite in ("packing", "all"):
            path = tiny_hf_checkpoint(os.path.join(tmp, "long"), "qwen3", vocab_size=args.vocab,
                                      **{**MODEL, "max_position_embeddings": 1024})
            rows = result["packing"] = _packing_suite(path, args.vocab, args.steps)
            first = next(r for r in rows if "train_s" in r)
            _print_packing(rows, f"Qwen3 4x256 (FFN 768), vocab {args.vocab}, 32 sequences: 32 prompt + lognormal "
                                 f"response tokens (longest {first['longest']}, response mean/max "
                                 f"{first['mean_over_max_response']:.2f}, {first['real_tokens']} real tokens)")
        if args.suite in ("tiny", "all"):
            from megatron_rl.data.tiny_task import TINY_QWEN3

            path = tiny_hf_checkpoint(os.path.join(tmp, "tiny"), "qwen3", **TINY_QWEN3)
            rows = result["tiny"] = _tiny_suite(path, args.steps)
            _print_packing(rows, f"the tiny recipe's model and batch shape (Qwen3 2x64, vocab 64, 512 sequences, "
                                 f"{rows[0]['real_tokens']} real tokens)")
        if args.suite in ("uniform", "all"):
            result["uniform"] = _uniform_suite(tmp, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


def _uniform_suite(tmp: str, args) -> list:
    tokens = BATCH * (PROMPT + RESPONSE)
    rows = []
    path = tiny_hf_checkpoint(os.path.join(tmp, "qwen3"), "qwen3", vocab_size=args.vocab, **MODEL)
    runs = [  # name, processes, function, ranks, arguments after (path, vocab, steps)
        ("ours TP=1", "1 proc x 2 threads", _ours, 1, (1,)),
        ("ours TP=1, plain Adam", "1 proc x 2 threads", _ours, 1, (1, False)),
        ("ours TP=2", "2 procs x 1 thread", _ours, 2, (2,)),
        ("ours TP=1, unfused head", "1 proc x 2 threads", _ours, 1, (1, True, False)),
        ("ours TP=2, unfused head", "2 procs x 1 thread", _ours, 2, (2, True, False)),
        ("HF + PG loss", "1 proc x 2 threads", _hf, 1, ("pg",)),
        ("HF + CE", "1 proc x 2 threads", _hf, 1, ("ce",)),
    ]
    wanted = [w.strip() for w in args.rows.split(",") if w.strip()]
    for name, procs, fn, n, extra in runs:
        if wanted and not any(name.startswith(w) for w in wanted):
            continue
        if fn is _ours:
            r = run_distributed(fn, n, path, extra[0], args.vocab, args.steps, *extra[1:], threads_per_rank=2 // n,
                                timeout_s=1800)[0]
        else:
            r = run_distributed(fn, n, path, args.vocab, args.steps, *extra, threads_per_rank=2, timeout_s=1800)[0]
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
    return rows


if __name__ == "__main__":
    main()
