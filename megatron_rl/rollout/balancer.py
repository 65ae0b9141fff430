"""``RemoteEngine``: the ``RolloutEngine`` protocol over one or more HTTP servers (SGLang or embedded).

Requests are spread over servers by ``policy``: ``"round_robin"`` or ``"least_outstanding"`` (the
server with the fewest requests in flight from this engine; ties go round-robin). Each request is one
``/generate`` call carrying its ``n``, so a request's samples come from one server (prefix sharing).
This is an in-process balancer; ``sglang-router`` (a separate process) can sit in front of the
servers instead, in which case give ``RemoteEngine`` the router's single URL.

Weight updates go to every server, over one of two transports:
* ``"tensor"``: ``/update_weights_from_tensor`` with safetensors payloads (the embedded server only).
* ``"distributed"``: ``/update_weights_from_distributed`` + a broadcast on a process group this engine
  hosts as rank 0 (SGLang's protocol; gloo on CPU, nccl on GPU). Call ``init_weight_sync`` first.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, List, Sequence

from megatron_rl.rollout.http_client import SGLangClient
from megatron_rl.rollout.protocol import EngineHealth, GenerateRequest, NamedTensorBucket, RolloutEngine, Sample
from megatron_rl.rollout import weight_group

POLICIES = ("round_robin", "least_outstanding")
TRANSPORTS = ("tensor", "distributed")


class RemoteEngine(RolloutEngine):
    def __init__(self, clients: Sequence[SGLangClient], policy: str = "least_outstanding",
                 weight_transport: str = "tensor", max_concurrency: int = 64):
        if not clients:
            raise ValueError("RemoteEngine needs at least one SGLangClient")
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: expected one of {POLICIES}")
        if weight_transport not in TRANSPORTS:
            raise ValueError(f"weight_transport={weight_transport!r}: expected one of {TRANSPORTS}")
        self.clients = list(clients)
        self.policy, self.weight_transport = policy, weight_transport
        self.outstanding = [0] * len(self.clients)
        self._rr = itertools.cycle(range(len(self.clients)))
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="rollout-http")
        self._group = None
        self._group_name = "weight_update_group"
        self.weight_version = "default"

    def _pick(self) -> int:
        with self._lock:
            if self.policy == "round_robin":
                i = next(self._rr)
            else:
                start = next(self._rr)  # rotate the starting point so ties spread evenly
                order = [(start + k) % len(self.clients) for k in range(len(self.clients))]
                i = min(order, key=lambda j: self.outstanding[j])
            self.outstanding[i] += 1
            return i

    def _run_one(self, req: GenerateRequest) -> List[Sample]:
        i = self._pick()
        try:
            return self.clients[i].generate_one(req)
        finally:
            with self._lock:
                self.outstanding[i] -= 1

    def generate(self, requests: Sequence[GenerateRequest]) -> List[Sample]:
        futures = [self._pool.submit(self._run_one, r) for r in requests]
        return [s for f in futures for s in f.result()]

    def _each(self, fn) -> List[Any]:
        """Run ``fn(client)`` on every server concurrently; re-raise the first failure."""
        futures = [self._pool.submit(fn, c) for c in self.clients]
        return [f.result() for f in futures]

    def prompt_logprobs(self, token_ids: Sequence[int]) -> List[Any]:
        """One ``[L - 1]`` tensor per server, in ``clients`` order (each server is checked on its own)."""
        return self._each(lambda c: c.prompt_logprobs(token_ids))

    # ---- weights -----------------------------------------------------------------------------------

    def init_weight_sync(self, master_address: str, master_port: int, backend: str = "gloo",
                         ranks_per_server: int = 1, timeout_s: float = 300.0) -> None:
        """Host the weight group as rank 0; server ``i`` joins at ``rank_offset = 1 + i*ranks_per_server``.
        ``master_port=0``: a port the OS picks, bound before any server is told about it (recommended)."""
        world = 1 + ranks_per_server * len(self.clients)
        store = weight_group.host_store(master_address, world, timeout_s) if master_port == 0 else None
        port = store.port if store is not None else master_port
        futures = [self._pool.submit(c.init_weights_update_group, master_address, port,
                                     1 + i * ranks_per_server, world, self._group_name, backend)
                   for i, c in enumerate(self.clients)]
        self._group = weight_group.create_weight_group(master_address, port, 0, world, backend,
                                                       self._group_name, timeout_s, store=store)
        for f in futures:
            f.result()

    def update_weights(self, named_tensor_buckets: Iterable[NamedTensorBucket], version: Any) -> None:
        version = str(version)
        if self.weight_transport == "tensor":
            for bucket in named_tensor_buckets:
                bucket = list(bucket)
                self._each(lambda c: c.update_weights_from_tensor([bucket], None, flush_cache=False))
        else:
            if self._group is None:
                raise RuntimeError("weight_transport='distributed' needs init_weight_sync(...) first")
            for bucket in named_tensor_buckets:
                bucket = list(bucket)
                futures = [self._pool.submit(c.update_weights_from_distributed, bucket, self._group_name)
                           for c in self.clients]
                weight_group.broadcast_bucket(self._group, bucket)
                for f in futures:
                    f.result()
        self._each(lambda c: c.flush_cache())
        self._each(lambda c: c.update_weight_version(version))
        self.weight_version = version

    # ---- lifecycle ---------------------------------------------------------------------------------

    def release_memory(self) -> None:
        self._each(lambda c: c.release_memory_occupation())

    def resume_memory(self) -> None:
        self._each(lambda c: c.resume_memory_occupation())

    def health(self) -> EngineHealth:
        ok = self._each(lambda c: c.health())
        bad = [c.url for c, good in zip(self.clients, ok) if not good]
        return EngineHealth(healthy=not bad, weight_version=self.weight_version,
                            detail=f"unhealthy: {bad}" if bad else "")

    def shutdown(self) -> None:
        """Stops this engine's threads; the servers belong to whoever launched them."""
        self._pool.shutdown(wait=False, cancel_futures=True)
