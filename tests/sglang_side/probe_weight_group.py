"""Trainer side (rank 0) of a weight-update group toward SGLang's own engine-rank code: a probe.

Plain torch only (runs in the main venv, torch 2.13, or any other): no sglang, no megatron_rl.
It spawns `weight_group_rank.py` with the SGLang venv's python as rank 1, builds rank 0 of the
group the way `sglang.srt.utils.common.init_custom_process_group` builds it (so both sides use
the same store keys), announces buckets on the child's stdin as `/update_weights_from_distributed`
bodies, broadcasts them over gloo, and compares SGLang's float64 checksums with its own.

    python tests/sglang_side/probe_weight_group.py [--sglang-python .venv-sglang/bin/python]

The group join, for the trainer (what defect 2 of issue 11 is about):
    store = PrefixStore(group_name, TCPStore(addr, port, world_size, is_master=True))
    pg, _ = distributed_c10d._new_process_group_helper(world_size, 0, [], Backend("gloo"), store,
                                                       group_name=group_name, timeout=...)
    distributed_c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
then `dist.broadcast(t, src=0, group=pg)` per tensor in announce order ("flattened_bucket": one
uint8 tensor, the concatenation of `t.flatten().view(torch.uint8)` in announce order; every
tensor's byte offset must be a multiple of its dtype's itemsize or SGLang refuses the bucket).

Output: one JSON object {"ok": bool, "trainer_torch", "engine_torch", "buckets": [{"index",
"load_format", "success", "match", "mismatched": [...]}], "destroyed": bool}; exit code 0 iff ok.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

import _common

def create_trainer_group(address, port, world_size, group_name, timeout_s):
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, is_master=True, timeout=timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, 0, [], Backend("gloo"), store,
                                      group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def example_buckets():
    g = torch.Generator().manual_seed(0)
    plain = {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(12, 8, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(8, generator=g).to(torch.float16),
        "router.expert_bias": torch.arange(6, dtype=torch.int64),
    }
    flat = {  # byte offsets 0, 96, 352: each aligned to its dtype
        "lm_head.weight": torch.randn(6, 4, generator=g),
        "model.layers.1.mlp.gate.weight": torch.randn(8, 16, generator=g).to(torch.bfloat16),
        "model.layers.1.input_layernorm.weight": torch.randn(8, generator=g),
    }
    return [(plain, None), (flat, "flattened_bucket")]


def announce(named: dict, load_format, group_name) -> dict:
    return {"names": list(named), "dtypes": [str(t.dtype).removeprefix("torch.") for t in named.values()],
            "shapes": [list(t.shape) for t in named.values()], "group_name": group_name,
            "load_format": load_format, "flush_cache": False}


def broadcast_bucket(pg, named: dict, load_format):
    if load_format == "flattened_bucket":
        flat = torch.cat([t.flatten().view(torch.uint8) for t in named.values()])
        dist.broadcast(flat, src=0, group=pg)
    else:
        for t in named.values():
            dist.broadcast(t.contiguous(), src=0, group=pg)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sglang-python", default=_common.default_sglang_python())
    parser.add_argument("--group-name", default="megatron_rl_weights")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv[1:])
    port = _common.free_port()
    child = subprocess.Popen(
        [args.sglang_python, os.path.join(_common.HERE, "weight_group_rank.py"),
         "--master-address", "127.0.0.1", "--master-port", str(port), "--rank-offset", "1",
         "--world-size", "2", "--group-name", args.group_name,
         "--deadline-s", str(int(args.timeout_s * 3))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    report = {"ok": False, "trainer_torch": torch.__version__, "buckets": [], "destroyed": False}
    try:
        pg = create_trainer_group("127.0.0.1", port, 2, args.group_name, args.timeout_s)
        joined = json.loads(child.stdout.readline())
        report["engine_torch"] = joined.get("torch")
        if not joined.get("success"):
            raise RuntimeError(f"engine rank refused the join: {joined}")
        for index, (named, load_format) in enumerate(example_buckets()):
            child.stdin.write(json.dumps(announce(named, load_format, args.group_name)) + "\n")
            child.stdin.flush()
            broadcast_bucket(pg, named, load_format)
            got = json.loads(child.stdout.readline())
            want = {name: _common.tensor_summary(t) for name, t in named.items()}
            mismatched = [n for n in want if got.get("tensors", {}).get(n) != want[n]]
            report["buckets"].append({"index": index, "load_format": load_format,
                                      "success": got.get("success"), "message": got.get("message"),
                                      "match": not mismatched, "mismatched": mismatched})
        child.stdin.close()
        report["destroyed"] = bool(json.loads(child.stdout.readline()).get("success"))
        dist.destroy_process_group(pg)
        report["ok"] = report["destroyed"] and all(b["success"] and b["match"] for b in report["buckets"])
    finally:
        if child.poll() is None:
            try:
                child.wait(timeout=args.timeout_s)
            except subprocess.TimeoutExpired:
                child.kill()
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
