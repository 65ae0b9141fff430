#!/usr/bin/env python
"""Launch-count bench: the ATen ops one ``train_step`` and one ``forward`` dispatch, on CPU.

Every ATen op is one kernel launch (or more) on a GPU, so the count is the CPU-visible proxy of a
launch-bound step: it must not grow with the number of sequences in a packed micro-batch. Counted with
a ``TorchDispatchMode`` (autograd's backward ops included) around one call after a warm-up step.

Model: Qwen3 shape, 4 layers, hidden 64 (4 heads x 16, 2 KV heads), FFN 96, vocab 250, random weights.
Batch: N sequences of a 16-token prompt and a lognormal response (sigma 0.8, longest 96), packed under a
4096-token micro-batch budget (train and forward), 1 process, 1 thread. Also times the step (median of
``--steps``) and the NaN guard's pre-step check (``optim.nonfinite_weights=rollback``: the bound of
:mod:`megatron_rl.training.nan_guard`, median of 50 calls) as a share of it.

  python tools/bench_launches.py                       # N = 32, 64, 128
  python tools/bench_launches.py --sizes 64 --steps 5
Prints a markdown table; writes JSON to --out (default bench_results/bench_launches.json).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # multiproc: the multi-process launcher

from multiproc import run_distributed, tiny_hf_checkpoint  # noqa: E402

LAYERS, BUDGET, PROMPT, LONGEST = 4, 4096, 16, 96


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched while active (by overload packet name)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _batch(n: int, vocab: int = 250):
    from megatron_rl.training import TrainBatch

    g = torch.Generator().manual_seed(0)
    z = torch.distributions.Normal(0.0, 1.0).icdf((torch.arange(n) + 0.5) / n)
    lengths = torch.exp(0.8 * z)
    lengths = (lengths / lengths.max() * LONGEST).round().clamp(min=1).long()[torch.randperm(n, generator=g)]
    prompts = [torch.randint(0, vocab, (PROMPT,), generator=g) for _ in range(n)]
    responses = [torch.randint(0, vocab, (int(k),), generator=g) for k in lengths]
    batch = TrainBatch.from_sequences(prompts, responses, advantages=torch.randn(n, generator=g).tolist())
    lp = -torch.rand(batch.response_mask.shape, generator=g) * 3 - 5
    return batch.replace(rollout_logprobs=lp, old_logprobs=lp + 0.01)


def _count(fn):
    with OpCounter() as c:
        fn()
    return c


def _timed(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _worker(path: str, sizes, steps: int):
    import torch.distributed as dist

    from megatron_rl import parallel
    from megatron_rl.models import attention
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.training import OptimConfig, PolicyTrainer, TrainConfig, nan_guard

    groups = parallel.init_megatron_parallel(parallel.ParallelLayout())
    cfg = TrainConfig(max_tokens_per_micro_batch=BUDGET, forward_max_tokens_per_micro_batch=BUDGET)
    tr = PolicyTrainer(ModelConfig(hf_path=path), cfg, groups, OptimConfig(lr=1e-6, nonfinite_weights="rollback"))
    rows = []
    for n in sizes:
        batch = _batch(n)
        tr.train_step(batch)  # warm-up
        tr.forward(batch)
        mbs = int(tr.train_step(batch).metrics["batch/micro_batches"])
        fwd_mbs = max(1, -(-int(batch.seq_lengths.sum()) // BUDGET))
        row = {"sequences": n, "tokens": int(batch.seq_lengths.sum()), "micro_batches": mbs}
        for impl in ("padded", "auto"):  # one call per layer (the GPU paths' structure); the CPU default
            attention.PACKED_IMPL = impl
            train, fwd = _count(lambda: tr.train_step(batch)), _count(lambda: tr.forward(batch))
            row[impl] = {"train_ops": train.total, "forward_ops": fwd.total,
                         "train_ops_per_layer_mb": train.total / (LAYERS * mbs),
                         "forward_ops_per_layer_mb": fwd.total / (LAYERS * fwd_mbs),
                         "top_train_ops": dict(train.counts.most_common(8))}
        if steps:
            params = list(tr.module.parameters())

            def guard():
                bound = float(nan_guard.max_abs_weight(tr.optimizer))
                return nan_guard.step_cannot_overflow(tr.optimizer, bound, params)

            assert guard(), "the NaN guard's bound should prove this step safe"
            row["step_s"] = _timed(lambda: tr.train_step(batch), steps)
            row["guard_s"] = _timed(guard, 50)
        rows.append(row)
    dist.barrier()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--steps", type=int, default=3, help="timed train steps per guard mode (0: counts only)")
    ap.add_argument("--out", default="bench_results/bench_launches.json")
    ap.add_argument("--label", default="", help="free text stored in the JSON (e.g. 'before')")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_hf_checkpoint(tmp, "qwen3", num_hidden_layers=LAYERS, max_position_embeddings=256)
        rows = run_distributed(_worker, 1, path, args.sizes, args.steps, timeout_s=1800, threads_per_rank=1)[0]
    print("| sequences | tokens | micro-batches | attention | train ops | ops / layer x mb | forward ops | "
          "fwd ops / layer x mb |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        for impl, what in (("padded", "one call / layer"), ("auto", "CPU default (per length)")):
            c = r[impl]
            print(f"| {r['sequences']} | {r['tokens']} | {r['micro_batches']} | {what} | {c['train_ops']} | "
                  f"{c['train_ops_per_layer_mb']:.0f} | {c['forward_ops']} | {c['forward_ops_per_layer_mb']:.0f} |")
    print("\n| sequences | train step (CPU default) | NaN guard check | guard / step |\n|---|---|---|---|")
    for r in rows:
        if "step_s" in r:
            print(f"| {r['sequences']} | {r['step_s'] * 1e3:.0f} ms | {r['guard_s'] * 1e3:.3f} ms | "
                  f"{r['guard_s'] / r['step_s']:.2%} |")
    by_n = {r["sequences"]: r for r in rows}
    if 32 in by_n and 64 in by_n:
        for impl in ("padded", "auto"):
            print(f"train ops 64 / 32 sequences ({impl}): {by_n[64][impl]['train_ops'] / by_n[32][impl]['train_ops']:.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"label": args.label, "layers": LAYERS, "budget": BUDGET, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
