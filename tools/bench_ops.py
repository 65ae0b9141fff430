#!/usr/bin/env python
"""Benchmark: per-token log-prob + entropy over vocabulary-sharded logits, forward + backward.

Methods (the loss is sum(w1 * logprob) + sum(w2 * entropy), so both gradients flow):
  a  ours: megatron_rl.ops.vocab_parallel_stats (fused, chunked, recompute in backward)
  b  peers: megatron-core vocab_parallel_cross_entropy, then a separate vocab-parallel entropy
     autograd Function (verl's _VocabParallelEntropy recipe) over an fp32 copy of the logits
  c  unsharded torch: log_softmax + gather + entropy (TP=1 only)
The output layer included (hidden states [T, H] and this rank's weight [V/TP, H] in, gradients of both out):
  f  fused head: megatron_rl.ops.vocab_parallel_linear_stats (logits block by block, recomputed in backward)
  u  unfused: logits = hidden @ W^T (materialised), then a (ours)

Each (method, T, V, TP) runs in fresh processes (gloo, one per TP rank; 2 CPU threads in total).
Memory: each rank resets its peak RSS (/proc/self/clear_refs) after the inputs exist, runs
forward + backward, and reads VmHWM. "peak extra" = peak RSS - RSS with inputs; "working" = peak
extra - the gradients every method must return ([T, V_local] for a/b/c; [T, H] + [V_local, H] for f/u).
Figures are per rank. An address-space
limit turns cases that do not fit into "OOM" rows instead of waking the OOM killer.

  python tools/bench_ops.py                 # full grid, ~15 min on 2 cores
  python tools/bench_ops.py --quick         # small sizes, ~1 min
  python tools/bench_ops.py --methods u,f --dtype float32   # fused vs unfused head, H = --hidden (1024)
Writes a markdown table to stdout and JSON to --out (default bench_results/bench_ops.json).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # multiproc: the multi-process launcher

from multiproc import DistributedTestError, run_distributed  # noqa: E402


class _PeerEntropy(torch.autograd.Function):
    """verl-style vocab-parallel entropy: materialises and saves the fp32 softmax (the peer recipe)."""

    @staticmethod
    def forward(ctx, logits, group):
        logits = logits.float()
        m = logits.max(-1, keepdim=True).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        exp = (logits - m).exp_()
        s = exp.sum(-1, keepdim=True)
        dist.all_reduce(s, group=group)
        softmax = exp.div_(s)
        sum_pz = (softmax * logits).sum(-1, keepdim=True)
        dist.all_reduce(sum_pz, group=group)
        ctx.save_for_backward(logits, softmax, sum_pz)
        return (m + s.log() - sum_pz).squeeze(-1)

    @staticmethod
    def backward(ctx, g):
        logits, softmax, sum_pz = ctx.saved_tensors
        return g.unsqueeze(-1) * softmax * (sum_pz - logits), None


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _make_inputs(rows: int, v_local: int, dtype: torch.dtype, rank: int):
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.empty(rows, v_local, dtype=dtype)
    step = max(1, (1 << 24) // v_local)
    for s in range(0, rows, step):  # chunked so no full-size fp32 temporary inflates the baseline
        x[s:s + step] = torch.randn(min(step, rows - s), v_local, generator=g) * 3
    tg = torch.Generator().manual_seed(7)
    targets = torch.randint(0, v_local * dist.get_world_size(), (rows,), generator=tg)
    return x.requires_grad_(), targets


def _make_head_inputs(rows: int, v_local: int, hidden: int, rank: int):
    g = torch.Generator().manual_seed(2000 + rank)
    h = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(3)) / hidden ** 0.5 * 3
    w = torch.randn(v_local, hidden, generator=g)
    targets = torch.randint(0, v_local * dist.get_world_size(), (rows,), generator=torch.Generator().manual_seed(7))
    return h.requires_grad_(), w.requires_grad_(), targets


def _worker(method: str, rows: int, vocab: int, dtype_name: str, reps: int, mem_limit: int, hidden: int = 1024):
    rank, world = dist.get_rank(), dist.get_world_size()
    resource.setrlimit(resource.RLIMIT_AS, (mem_limit, mem_limit))
    group = dist.group.WORLD
    if method == "b":
        from megatron_rl.parallel import ParallelLayout, init_megatron_parallel

        init_megatron_parallel(ParallelLayout(tp=world))
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron_rl.ops import vocab_parallel_linear_stats, vocab_parallel_stats

    dtype = getattr(torch, dtype_name)
    v_local = vocab // world
    w1 = torch.randn(rows)
    w2 = torch.randn(rows)
    times_f, times_b, extras = [], [], []
    head = method in ("f", "u")
    try:
        if head:
            x, w, targets = _make_head_inputs(rows, v_local, hidden, rank)
            x, w = x.to(dtype).detach().requires_grad_(), w.to(dtype).detach().requires_grad_()
        else:
            x, targets = _make_inputs(rows, v_local, dtype, rank)
        for _ in range(reps):
            x.grad = None
            if head:
                w.grad = None
            dist.barrier()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM (peak RSS) to the current RSS
            base = _rss_bytes("VmRSS")
            t0 = time.perf_counter()
            tp_group = group if world > 1 else None
            if method == "a":
                st = vocab_parallel_stats(x, targets, tp_group=tp_group)
                lp, ent = st.logprobs, st.entropy
            elif method == "f":
                st = vocab_parallel_linear_stats(x, w, targets, tp_group=tp_group)
                lp, ent = st.logprobs, st.entropy
            elif method == "u":
                st = vocab_parallel_stats(x @ w.t(), targets, tp_group=tp_group)
                lp, ent = st.logprobs, st.entropy
            elif method == "b":
                lp = -vocab_parallel_cross_entropy(x, targets)
                ent = _PeerEntropy.apply(x, group)
            else:
                lsm = torch.log_softmax(x.float(), -1)
                lp = lsm.gather(-1, targets[:, None]).squeeze(-1)
                ent = -(lsm.exp() * lsm).sum(-1)
            loss = (lp * w1).sum() + (ent * w2).sum()
            dist.barrier()
            t1 = time.perf_counter()
            loss.backward()
            dist.barrier()
            t2 = time.perf_counter()
            extras.append(_rss_bytes("VmHWM") - base)
            times_f.append(t1 - t0)
            times_b.append(t2 - t1)
            del lp, ent, loss
            if method in ("a", "f", "u"):
                del st
            elif method == "c":
                del lsm
    except (RuntimeError, MemoryError) as e:
        if "memory" in str(e).lower():
            return {"status": "OOM"}
        raise
    grad_bytes = x.numel() * x.element_size() + (w.numel() * w.element_size() if head else 0)
    return {
        "status": "ok",
        "fwd_s": min(times_f),
        "bwd_s": min(times_b),
        "total_s": min(times_f) + min(times_b),
        "peak_extra_bytes": max(extras),
        "grad_bytes": grad_bytes,
        "working_bytes": max(extras) - grad_bytes,
        "input_bytes": grad_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", default="2048,8192,32768", help="comma-separated token counts")
    ap.add_argument("--V", default="32768,152064", help="comma-separated (padded) vocabulary sizes")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--methods", default="a,b,c")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--append", action="store_true", help="add rows to --out's JSON (a grid run in pieces)")
    ap.add_argument("--reps", type=int, default=2, help="repetitions per case; the minimum is reported")
    ap.add_argument("--mem-limit-gib", type=float, default=21.0, help="address-space limit per case (all ranks)")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size H of the output-layer methods f, u")
    ap.add_argument("--quick", action="store_true", help="T=1024,4096 V=32768 only")
    ap.add_argument("--out", default="bench_results/bench_ops.json")
    args = ap.parse_args()
    if args.quick:
        args.T, args.V = "1024,4096", "32768"
    cores = os.cpu_count() or 1
    # Every allocation above 128 KiB gets its own mapping and is unmapped when freed, so RSS tracks
    # live tensor bytes (glibc's default would keep freed buffers resident and hide reuse).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    rows = []
    for vocab in map(int, args.V.split(",")):
        for T in map(int, args.T.split(",")):
            for tp in map(int, args.tp.split(",")):
                for method in args.methods.split(","):
                    if method == "c" and tp != 1:
                        continue
                    limit = int(args.mem_limit_gib * 2**30 / tp) + (3 << 30)  # + libraries' address space
                    label = f"method={method} T={T} V={vocab} TP={tp}"
                    print(f"running {label} ...", file=sys.stderr, flush=True)
                    try:
                        res = run_distributed(_worker, tp, method, T, vocab, args.dtype, args.reps, limit,
                                              args.hidden, timeout_s=7200, threads_per_rank=max(1, cores // tp))
                        r = max(res, key=lambda d: d.get("total_s", 0)) if all(
                            d["status"] == "ok" for d in res) else {"status": "OOM"}
                    except DistributedTestError as e:
                        msg = str(e)
                        oom = "memory" in msg.lower() or "died" in msg
                        r = {"status": "OOM" if oom else "error", "detail": msg[-500:]}
                    r.update(method=method, T=T, V=vocab, tp=tp, dtype=args.dtype, load_avg=os.getloadavg()[0],
                             **({"hidden": args.hidden} if method in ("f", "u") else {}))
                    rows.append(r)
    out = Path(args.out)
    if args.append and out.exists():
        rows = json.loads(out.read_text())["rows"] + rows
    _print_table(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cores": cores, "torch": torch.__version__, "rows": rows}, indent=2))
    print(f"\nwrote {out}", file=sys.stderr)


def _print_table(rows) -> None:
    lm = [r for r in rows if r["method"] in ("a", "b", "c")]
    if lm:
        _print_logits_table(lm)
    head = [r for r in rows if r["method"] in ("f", "u")]
    if head:
        print()
        _print_head_table(head)


def _print_head_table(rows) -> None:
    gib = 2**30
    names = {"f": "f: fused head", "u": "u: matmul + a"}
    print("| T | V | TP | H | method | fwd s | bwd s | total s | time vs u | peak extra GiB | vs u | working GiB "
          "| load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    unfused = {(r["T"], r["V"], r["tp"]): r for r in rows if r["method"] == "u" and r["status"] == "ok"}
    for r in sorted(rows, key=lambda r: (r["V"], r["T"], r["tp"], r["method"] != "u")):
        head = f"| {r['T']} | {r['V']} | {r['tp']} | {r.get('hidden', '')} | {names[r['method']]} |"
        if r["status"] != "ok":
            print(f"{head} {r['status']} | | | | | | | {r.get('load_avg', 0):.1f} |")
            continue
        base = unfused.get((r["T"], r["V"], r["tp"]))
        t_rel = m_rel = ""
        if r["method"] == "f" and base is not None:
            t_rel = f"{r['total_s'] / base['total_s']:.2f}x"
            m_rel = f"{100 * r['peak_extra_bytes'] / base['peak_extra_bytes']:.1f} %"
        print(f"{head} {r['fwd_s']:.2f} | {r['bwd_s']:.2f} | {r['total_s']:.2f} | {t_rel} |"
              f" {r['peak_extra_bytes'] / gib:.3f} | {m_rel} | {r['working_bytes'] / gib:.3f} |"
              f" {r.get('load_avg', 0):.1f} |")


def _print_logits_table(rows) -> None:
    gib = 2**30
    names = {"a": "a: ours (fused, chunked)", "b": "b: megatron CE + peer entropy", "c": "c: unsharded torch"}
    print("| T | V | TP | method | fwd s | bwd s | total s | speed-up of a | peak extra GiB | working GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ours = {(r["T"], r["V"], r["tp"]): r for r in rows if r["method"] == "a" and r["status"] == "ok"}
    for r in rows:
        key = (r["T"], r["V"], r["tp"])
        head = f"| {r['T']} | {r['V']} | {r['tp']} | {names[r['method']]} |"
        if r["status"] != "ok":
            print(f"{head} {r['status']} | | | | | |")
            continue
        speed = ""
        if r["method"] != "a" and key in ours:
            speed = f"{r['total_s'] / ours[key]['total_s']:.2f}x"
        print(f"{head} {r['fwd_s']:.3f} | {r['bwd_s']:.3f} | {r['total_s']:.3f} | {speed} |"
              f" {r['peak_extra_bytes'] / gib:.3f} | {r['working_bytes'] / gib:.3f} |")


if __name__ == "__main__":
    main()
