"""Producer side of `/update_weights_from_tensor` with CPU tensors, checked by SGLang's decoder: a probe.

Plain torch only (runs in the main venv, torch 2.13, or any other): no sglang, no megatron_rl.
It builds the request body as a colocated trainer would, keeps the tensors alive, runs
`deserialize_tensors.py` in the SGLang venv for every TP rank, and compares checksums.

    python tests/sglang_side/probe_tensor_payload.py [--sglang-python P] [--strategy file_system]
        [--load-format none|flattened_bucket] [--tp-size 2]

What a producer does (CPU tensors; CUDA tensors travel as CUDA-IPC handles instead):
* `torch.multiprocessing.set_sharing_strategy("file_system")` before pickling. The default
  "file_descriptor" strategy pickles a `multiprocessing.resource_sharer.DupFd`: the consumer
  must connect back to the producer's resource-sharer socket and authenticate with the
  producer's `multiprocessing` authkey, which an independent process (the SGLang server) does not
  have, so it fails there. "file_system" pickles `rebuild_storage_filename` (a /dev/shm name via
  torch_shm_manager), which any process on the machine can open.
* pickle with `multiprocessing.reduction.ForkingPickler` (after `import torch.multiprocessing`,
  which registers torch's reductions), one payload per SGLang TP rank, base64 (str) each:
  load_format null: a list of `(name, tensor)`;
  load_format "flattened_bucket": `{"flattened_tensor": uint8 tensor (the concatenation of
  `t.flatten().view(torch.uint8)`), "metadata": [entries with attributes name, shape
  (torch.Size), dtype (torch.dtype), start_idx, end_idx, numel (bytes)]}`; SGLang's SafeUnpickler
  admits `types.SimpleNamespace` (used here, no sglang import needed) or SGLang's own
  `FlattenedTensorMetadata`, not a class of ours.
* keep every pickled tensor (and its storage) alive until the engine has answered: the shared
  memory is unlinked when the producer's last reference dies (on CUDA: same for the IPC handle).

Output: one JSON object {"ok", "strategy", "load_format", "ranks": [{"tp_rank", "ok", "stage",
"error", "match"}]}; exit code 0 iff ok.
"""

import argparse
import base64
import io
import json
import os
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace

import torch
import torch.multiprocessing

import _common

def serialize(obj) -> str:
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def flattened_bucket(named: dict) -> dict:
    parts, metadata, offset = [], [], 0
    for name, t in named.items():
        flat = t.contiguous().flatten().view(torch.uint8)
        metadata.append(SimpleNamespace(name=name, shape=t.shape, dtype=t.dtype, start_idx=offset,
                                        end_idx=offset + flat.numel(), numel=flat.numel()))
        parts.append(flat)
        offset += flat.numel()
    return {"flattened_tensor": torch.cat(parts), "metadata": metadata}


def rank_tensors(tp_rank: int) -> dict:
    g = torch.Generator().manual_seed(100 + tp_rank)  # a different shard per TP rank
    return {
        "model.layers.0.self_attn.qkv_proj.weight": torch.randn(12, 8, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(8, 6, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(8, generator=g),
    }


def build(strategy: str, load_format, tp_size: int):
    """(body, per-rank tensors, expected per-rank checksums); keep the tensors' process alive."""
    torch.multiprocessing.set_sharing_strategy(strategy)
    per_rank = [rank_tensors(r) for r in range(tp_size)]
    objs = [flattened_bucket(n) if load_format else list(n.items()) for n in per_rank]
    body = {"serialized_named_tensors": [serialize(o) for o in objs], "load_format": load_format,
            "flush_cache": False}
    expected = [[{"name": n, **_common.tensor_summary(t)} for n, t in named.items()] for named in per_rank]
    return body, per_rank, expected


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sglang-python", default=_common.default_sglang_python())
    parser.add_argument("--strategy", default="file_system", choices=["file_system", "file_descriptor"])
    parser.add_argument("--load-format", default="none", choices=["none", "flattened_bucket"])
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--emit", action="store_true",
                        help="print {body, expected} as one JSON line, then hold the tensors "
                             "until stdin closes")
    args = parser.parse_args(argv[1:])
    load_format = None if args.load_format == "none" else args.load_format
    body, per_rank, expected = build(args.strategy, load_format, args.tp_size)
    if args.emit:
        print(json.dumps({"body": body, "expected": expected}), flush=True)
        sys.stdin.read()
        return 0
    jobs = [{"body": body, "tp_rank": r} for r in range(args.tp_size)]
    proc = subprocess.run([args.sglang_python, os.path.join(_common.HERE, "deserialize_tensors.py")],
                          input=json.dumps(jobs), capture_output=True, text=True, timeout=args.timeout_s)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        return 2
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    report = {"ok": True, "strategy": args.strategy, "load_format": load_format, "ranks": []}
    for tp_rank, got in enumerate(results):
        match = got["tensors"] == expected[tp_rank]
        report["ranks"].append({"tp_rank": tp_rank, "ok": got["ok"], "stage": got["stage"],
                                "error": got["error"], "match": match})
        report["ok"] = report["ok"] and got["ok"] and match
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
