#!/usr/bin/env python
"""Benchmark: what running the embedded server as the engine actor's child process costs, and how long a
restart takes (engine recovery, ``megatron_rl/orchestration/engine_health.py``).

Two ways to host one embedded engine in a Ray actor (CPU, one thread each, a random Qwen3 checkpoint):

  in-actor   the former EngineWorker: EmbeddedEngine + EmbeddedServer threads inside the actor's process
  child      today's EngineWorker: ``python -m megatron_rl.rollout.embedded.server`` as a ManagedServer child

Columns: "start s" = actor created -> URL answered (interpreter, imports, model load); "PSS MiB" = the
proportional set size (shared pages split between the processes that map them) of the actor and of its
child server after start, and their sum; "rollout s" = ``--requests`` seeded requests of ``n=8`` samples through the
driver's RemoteEngine over HTTP (median of ``--repeats``, alternating between the two, both up at once;
the same tokens either way); "restart s" =
``EngineWorker.restart()`` (SIGKILL, launch on a fresh port, ``/health``; child only).

  python tools/bench_engine_recovery.py            # ~2-3 min on 2 cores
  python tools/bench_engine_recovery.py --hidden 64 --repeats 1
Prints a markdown table; writes JSON to --out (default bench_results/bench_engine_recovery.json).
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_weight_sync import make_checkpoint  # noqa: E402  (this directory: the same random Qwen3)


class InActorEngine:
    """The former EngineWorker's embedded path, kept here for the comparison."""

    def __init__(self, model_path: str):
        import torch

        torch.set_num_threads(1)
        self.model_path = model_path
        self.server = None

    def start(self) -> str:
        from megatron_rl.rollout.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
        from megatron_rl.rollout.embedded.server import EmbeddedServer

        engine = EmbeddedEngine.from_pretrained(self.model_path, EmbeddedEngineConfig(max_batch_rows=256,
                                                                                      seeds="deterministic"))
        self.server = EmbeddedServer(engine, model_path=self.model_path).start()
        return self.server.url

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self.server.stop()


def _pss_mib(pid: int) -> tuple:
    """(the process's PSS, its children's) in MiB."""
    import psutil

    proc = psutil.Process(pid)
    children = sum(p.memory_full_info().pss for p in proc.children(recursive=True))
    return proc.memory_full_info().pss / 2**20, children / 2**20


def _rollout(url: str, requests: int):
    """A function timing one rollout of ``requests`` seeded requests (n=8, 16 tokens) against ``url``."""
    from megatron_rl.rollout.client.balancer import RemoteEngine
    from megatron_rl.rollout.client.http_client import SGLangClient
    from megatron_rl.rollout.client.protocol import GenerateRequest, SamplingParams

    reqs = [GenerateRequest((10 + i % 50, 20, 30, 40), SamplingParams(max_new_tokens=16, n=8, seed=i, ignore_eos=True))
            for i in range(requests)]
    engine = RemoteEngine([SGLangClient(url)])

    def run() -> float:
        t = time.perf_counter()
        engine.generate(reqs)
        return time.perf_counter() - t

    return run, engine


def bench(model: str, log_dir: str, args) -> list:
    """Both hosts up at once; rollouts alternate between them (load drift hits both alike)."""
    import ray

    from megatron_rl.orchestration.engine_worker import EngineSpec, EngineWorker

    rows, actors, runs = [], [], []
    for kind in ("in-actor", "child"):
        t = time.perf_counter()
        if kind == "in-actor":
            actor = ray.remote(InActorEngine).options(num_cpus=1).remote(model)
        else:
            actor = ray.remote(EngineWorker).options(num_cpus=1).remote(
                EngineSpec(kind="embedded", model_path=model, log_dir=log_dir))
        url = ray.get(actor.start.remote())
        row = {"kind": kind, "start_s": time.perf_counter() - t}
        pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
        row["actor_pss_mib"], row["child_pss_mib"] = _pss_mib(pid)
        rows.append(row)
        actors.append(actor)
        runs.append(_rollout(url, args.requests))
    times = [[], []]
    for r in range(args.repeats + 1):  # the first round warms up; who goes first alternates
        for k in ((0, 1) if r % 2 else (1, 0)):
            seconds = runs[k][0]()
            if r:
                times[k].append(seconds)
    for row, t, (_, engine) in zip(rows, times, runs):
        row["rollout_s"], row["rollout_all_s"] = statistics.median(t), t
        engine.shutdown()
    restarts = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        ray.get(actors[1].restart.remote())
        restarts.append(time.perf_counter() - t)
    rows[1]["restart_s"] = statistics.median(restarts)
    for actor in actors:
        ray.get(actor.stop.remote())
        ray.kill(actor)
    return rows


def _table(rows) -> str:
    out = ["| engine host | start s | PSS MiB actor + child = total | rollout s | restart s |",
           "|---|---:|---:|---:|---:|"]
    for r in rows:
        restart = f"{r['restart_s']:.1f}" if "restart_s" in r else "-"
        pss = f"{r['actor_pss_mib']:.0f} + {r['child_pss_mib']:.0f} = {r['actor_pss_mib'] + r['child_pss_mib']:.0f}"
        out.append(f"| {r['kind']} | {r['start_s']:.1f} | {pss} | {r['rollout_s']:.2f} | {restart} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench_results/bench_engine_recovery.json")
    args = ap.parse_args()
    import ray

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        model = make_checkpoint(os.path.join(tmp, "model"), args.hidden)
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="warning",
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        try:
            rows = bench(model, tmp, args)
        finally:
            ray.shutdown()
    print(_table(rows))
    load = os.getloadavg()[0]
    print(f"\nhidden {args.hidden}, {args.requests} requests x 8 samples x 16 tokens; load average {load:.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "args": vars(args), "load_average": load}, indent=2))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
