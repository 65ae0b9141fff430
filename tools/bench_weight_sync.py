#!/usr/bin/env python
"""Benchmark: weight sync Megatron -> rollout engine (megatron_rl.weights.sync), CPU / gloo.

Model: a random Qwen3 (4 layers, hidden 512, 8 heads / 4 KV heads of 64, MLP 1536, vocabulary 32000,
untied lm_head; ~45M parameters, 181 MB in fp32). For TP = 1 and TP = 2 (one gloo process per rank)
the trainer's weights are synced to the engine beside rank 0; every rank sends the pieces it owns to rank 0
(``WeightSyncConfig.per_rank``; ``--all-gather``: the old export, every tensor all-gathered on every rank):

  embedded        the in-process EmbeddedEngine (fp32): each piece received in place into the HF model
  embedded-bf16   the same engine in bf16: tensors cast on the trainer side (half the bytes)
  http            an EmbeddedServer on loopback (a thread of rank 0's process) via RemoteEngine,
                  /update_weights_from_tensor (base64 safetensors buckets assembled on rank 0)
  http+gloo       an embedded server in its own process (as SGLang is: a group name exists once per process)
                  via /update_weights_from_distributed + a gloo broadcast
  ipc             the same server, emulating SGLang with TP = the trainer's TP, via the colocated transport:
                  every rank posts its own copy by handle in SGLang's /update_weights_from_tensor format
                  (flattened_bucket; shared-memory files on CPU where a GPU passes CUDA-IPC handles)

and compared with a plain in-memory copy of every HF tensor into a preallocated state dict
(``copy_``, same process): "x copy" = sync seconds / copy seconds. "link GB/s": per trainer rank that
sent something, its bytes over its seconds. Sync times exclude the post-sync check, timed separately
("check s": one probe forward on the trainer and one on the engine).
"peak extra" is rank 0's peak RSS growth during one sync (/proc/self/clear_refs + VmHWM): streaming
keeps it near one bucket (+ serialisation copies over HTTP), not a second model.

  python tools/bench_weight_sync.py            # ~2-3 min on 2 cores
  python tools/bench_weight_sync.py --quick    # hidden 256, 1 repeat
Prints a markdown table; writes JSON to --out (default bench_results/bench_weight_sync.json).
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

TARGETS = ("embedded", "embedded-bf16", "http", "http+gloo", "ipc")


def make_checkpoint(path: str, hidden: int) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads = hidden // 64
    cfg = Qwen3Config(vocab_size=32000, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=4,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64,
                      max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).float().save_pretrained(path)
    return path


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> int:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass
    return _rss("VmRSS")


def _engine(target: str, path: str, sender: bool, cleanup: list, tp: int, tmp: str):
    """(the sender's engine, every rank's transport: None but for ``ipc``)."""
    import torch.distributed as dist

    from megatron_rl.rollout.client.balancer import RemoteEngine
    from megatron_rl.rollout.embedded.engine import EmbeddedEngine
    from megatron_rl.rollout.client.http_client import SGLangClient
    from megatron_rl.rollout.client.ipc_transport import IpcTransport
    from megatron_rl.rollout.embedded.server import EmbeddedServer

    remote, url = None, [None]
    if sender:
        dtype = torch.bfloat16 if target == "embedded-bf16" else torch.float32
        if target == "http+gloo":
            from megatron_rl.rollout.client.process import launch_embedded_server

            server = launch_embedded_server(path, os.path.join(tmp, "server.log"))
        else:
            local = EmbeddedEngine.from_pretrained(path, dtype=dtype)
            if target.startswith("embedded"):
                return local, None
            server = EmbeddedServer(local, tp_size=tp if target == "ipc" else 1).start()
        cleanup.append(server.stop)
        url = [server.url]
        transport = "distributed" if "gloo" in target else "tensor"
        remote = RemoteEngine([SGLangClient(server.url)], weight_transport=transport)
        if "gloo" in target:
            remote.init_weight_sync("127.0.0.1", 0, backend="gloo", timeout_s=120)
    if target != "ipc":
        return remote, None
    dist.broadcast_object_list(url, src=0)
    return remote, IpcTransport(url)


def _copy_baseline(built, repeats: int) -> dict:
    """Every HF tensor copy_'d into a preallocated state dict: the floor for moving these bytes in memory."""
    from megatron_rl.models.weights import export_hf_state_dict

    src = export_hf_state_dict(built)
    dst = {n: torch.empty_like(t) for n, t in src.items()}
    times = []
    for _ in range(max(5, repeats) + 1):  # cheap: more repeats against a noisy shared machine
        t = time.perf_counter()
        for n, x in src.items():
            dst[n].copy_(x)
        times.append(time.perf_counter() - t)
    return dict(seconds=statistics.median(times[1:]), bytes=sum(x.numel() * x.element_size() for x in src.values()))


def child(path: str, tp: int, bucket_mb: float, repeats: int, targets, per_rank: bool = True) -> dict:
    import torch.distributed as dist

    from megatron_rl import parallel
    from megatron_rl.models.build import build_model
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.weights.sync import WeightSync, WeightSyncConfig

    sender = dist.get_rank() == 0
    groups = parallel.init_megatron_parallel(parallel.ParallelLayout(tp=tp))
    built = build_model(ModelConfig(hf_path=path), groups)
    out = {"copy": _copy_baseline(built, repeats)}
    for target in targets:
        cleanup: list = []
        try:
            engine, transport = _engine(target, path, sender, cleanup, tp, os.path.dirname(path))
            tol = 0.25 if target == "embedded-bf16" else 1e-4  # bf16 engine vs fp32 trainer
            timed = WeightSync(built, engine, WeightSyncConfig(bucket_mb=bucket_mb, check=False, progress=False,
                                                               per_rank=per_rank), transport=transport)
            runs, peak = [], 0
            for i in range(repeats + 1):  # the first run warms up (allocator, sockets, the engine's first
                dist.barrier()             # writes into its weights, which from_pretrained may have mmapped)
                base = _reset_peak()
                stats = timed.sync(version=i)
                if i:
                    peak = max(peak, _rss("VmHWM") - base)
                runs.append(stats)
            checked = WeightSync(built, engine, WeightSyncConfig(bucket_mb=bucket_mb, check_tolerance=tol,
                                                                 progress=False, per_rank=per_rank),
                                 transport=transport).sync("checked")
            last = runs[-1]
            out[target] = dict(seconds=statistics.median(r.seconds for r in runs[1:]),
                               gather_seconds=statistics.median(r.gather_seconds for r in runs[1:]),
                               bytes=last.bytes, buckets=last.buckets, tensors=last.tensors,
                               max_bucket_bytes=last.max_bucket_bytes, peak_extra_bytes=peak,
                               check_seconds=checked.check.seconds, check_max_abs_diff=checked.check.max_abs_diff,
                               link_gb_per_s=[round(n / 1e9 / max(t, 1e-9), 2)
                                              for n, t in zip(last.link_bytes, last.link_seconds) if n])
        finally:
            for stop in cleanup:
                stop()
    return out


def _table(rows) -> str:
    lines = ["| TP | target | MiB moved | buckets | sync s | of which gather s | GB/s | x copy_ | peak extra MiB "
             "| check s | check max abs diff | link GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["target"] == "copy_ (baseline)":
            lines.append(f"| {r['tp']} | {r['target']} | {r['bytes'] / 2**20:.0f} | - | {r['seconds']:.3f} | - | "
                         f"{r['bytes'] / 1e9 / r['seconds']:.2f} | 1.0 | - | - | - | - |")
            continue
        cells = [r["tp"], r["target"], f"{r['bytes'] / 2**20:.0f}", r["buckets"], f"{r['seconds']:.3f}",
                 f"{r['gather_seconds']:.3f}", f"{r['bytes'] / 1e9 / r['seconds']:.2f}", f"{r['ratio_to_copy']:.1f}",
                 f"{r['peak_extra_bytes'] / 2**20:.0f}", f"{r['check_seconds']:.2f}", f"{r['check_max_abs_diff']:.1e}",
                 " / ".join(str(x) for x in r["link_gb_per_s"])]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="hidden 256, one timed repeat")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    ap.add_argument("--bucket-mb", type=float, default=32.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--all-gather", action="store_true", help="the old export: every tensor all-gathered on every rank")
    ap.add_argument("--out", default="bench_results/bench_weight_sync.json")
    args = ap.parse_args()
    hidden, repeats = (256, 1) if args.quick else (args.hidden, args.repeats)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(os.path.join(tmp, "qwen3"), hidden)
        for tp in args.tp:
            t = time.perf_counter()
            # one thread per rank: on a small shared machine a 2-thread copy_ measured 10x slower than 1 thread
            result = run_distributed(child, tp, path, tp, args.bucket_mb, repeats, args.targets, not args.all_gather,
                                     timeout_s=900, threads_per_rank=1)[0]
            copy = result.pop("copy")
            rows.append(dict(tp=tp, target="copy_ (baseline)", **copy))
            for target, r in result.items():
                rows.append(dict(tp=tp, target=target, ratio_to_copy=r["seconds"] / copy["seconds"], **r))
            print(f"TP={tp} done in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    print(_table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(cores=os.cpu_count(), torch=torch.__version__, hidden=hidden, layers=4, vocab=32000,
                bucket_mb=args.bucket_mb, repeats=repeats, per_rank=not args.all_gather,
                load_average=os.getloadavg())
    out.write_text(json.dumps({"config": meta, "rows": rows}, indent=2))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
