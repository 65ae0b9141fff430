"""``RemoteEngine``: the ``RolloutEngine`` protocol over one or more HTTP servers (SGLang or embedded).

Requests are spread over servers by ``policy``: ``"round_robin"`` or ``"least_outstanding"`` (the
server with the fewest requests in flight from this engine; ties go round-robin). A request's ``n``
samples go to one server (prefix sharing). This is an in-process balancer; ``sglang-router`` (a separate
process) can sit in front of the servers instead, in which case give ``RemoteEngine`` the router's URL.

Weight updates go to every server inside SGLang's weight-update session (``/begin_weight_update`` on every
server first: SGLang refuses updates outside one, and a refused announce would leave the broadcast below
waiting forever; ``/end_weight_update`` on every server after the last bucket, also after a failure), then
one ``/flush_cache`` and the version. Two transports:

* ``"tensor"``: ``/update_weights_from_tensor`` with the embedded server's safetensors formats (embedded
  servers only).
* ``"distributed"``: ``/update_weights_from_distributed`` + a broadcast on a process group this engine
  hosts as rank 0 (SGLang's protocol; gloo on CPU, nccl on GPU), one ``flattened_bucket`` buffer per
  bucket. Call ``init_weight_sync`` first: it reads each server's TP size from ``/server_info`` (engine
  ranks are ``rank_offset + tp_rank``). SGLang answers an announce only after it has received the bucket,
  so acceptance is established beforehand (the session, the group); an announce refused anyway is
  noticed while the broadcast is pending, which is then abandoned with the server's message (the group
  is marked broken and rebuilt by the next ``init_weight_sync``) -- never a silent hang.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, List, Optional, Sequence

from megatron_rl.rollout import weight_group
from megatron_rl.rollout.http_client import SGLangClient
from megatron_rl.rollout.protocol import EngineHealth, GenerateRequest, NamedTensorBucket, RolloutEngine, Sample

log = logging.getLogger(__name__)

POLICIES = ("round_robin", "least_outstanding")
TRANSPORTS = ("tensor", "distributed")


class WeightTransportError(RuntimeError):
    """A server refused a weight bucket while the trainer was broadcasting it; the group is unusable."""


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
        self._group_generation = 0
        self._group_args: Optional[dict] = None
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
        """Run ``fn(client)`` on every server concurrently; re-raise the first failure (after all finished)."""
        futures = [self._pool.submit(fn, c) for c in self.clients]
        return [f.result() for f in [_settled(f) for f in futures]]

    def prompt_logprobs(self, token_ids: Sequence[int]) -> List[Any]:
        """One ``[L - 1]`` tensor per server, in ``clients`` order (each server is checked on its own)."""
        return self._each(lambda c: c.prompt_logprobs(token_ids))

    def prompt_logprobs_and_routes(self, token_ids: Sequence[int]) -> List[Any]:
        """Per server: ``([L - 1] log-probs, [L, moe layers, topk] routes)`` of the same scoring."""
        return self._each(lambda c: c.prompt_logprobs_and_routes(token_ids))

    # ---- weights -----------------------------------------------------------------------------------

    def init_weight_sync(self, master_address: str, master_port: int = 0, backend: str = "gloo",
                         timeout_s: float = 300.0, group_name: str = "megatron_rl_weights") -> None:
        """Host the weight group as rank 0; server ``i`` joins with ``rank_offset = 1 + sum of the TP sizes of
        servers before it`` (its TP ranks are ``rank_offset + tp_rank``; sizes from ``/server_info``).
        ``master_port=0``: a port the OS picks, bound before any server is told about it (recommended).
        Calling it again replaces the group (after a server restart, or a broken broadcast)."""
        self._destroy_group()
        sizes = [int(info.get("tp_size", 1)) * int(info.get("pp_size", 1) or 1)
                 for info in self._each(lambda c: c.server_info())]
        world = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        self._group_generation += 1
        # a fresh name each time: group names are process-wide on both sides, and a stale group may remain
        name = f"{group_name}_{self._group_generation}_{secrets.token_hex(4)}"
        store = weight_group.host_store(master_address, world, timeout_s) if master_port == 0 else None
        port = store.port if store is not None else master_port
        futures = [self._pool.submit(c.init_weights_update_group, master_address, port, off, world, name, backend)
                   for c, off in zip(self.clients, offsets)]
        try:
            group = weight_group.create_weight_group(master_address, port, 0, world, backend, name, timeout_s,
                                                     store=store)
        except Exception as e:
            failed = [f"{c.url}: {f.exception()}" for c, f in zip(self.clients, futures) if f.done() and f.exception()]
            raise RuntimeError(f"the weight group {name!r} (world {world}) did not form: {e}"
                               + (f"; servers refused: {failed}" if failed else "")) from None
        for f in futures:
            f.result()
        self._group, self._group_name, self._store = group, name, store
        self._group_args = dict(master_address=master_address, master_port=master_port, backend=backend,
                                timeout_s=timeout_s, group_name=group_name)
        log.info("weight group %r: trainer rank 0 + %d engine ranks (TP sizes %s)", name, world - 1, sizes)

    def _destroy_group(self) -> None:
        if self._group is None:
            return
        for c in self.clients:
            try:
                c.destroy_weights_update_group(self._group_name)
            except Exception as e:  # noqa: BLE001 - a dead server has no group to destroy
                log.debug("destroy_weights_update_group on %s: %s", c.url, e)
        weight_group.destroy_weight_group(self._group)
        self._group = None

    def update_weights(self, named_tensor_buckets: Iterable[NamedTensorBucket], version: Any) -> None:
        version = str(version)
        if self.weight_transport == "distributed" and self._group is None:
            raise RuntimeError("weight_transport='distributed' needs init_weight_sync(...) first" +
                               (" (the last sync broke the group)" if self._group_args else ""))
        try:
            self._each(lambda c: c.begin_weight_update())
            for bucket in named_tensor_buckets:
                bucket = list(bucket)
                if self.weight_transport == "tensor":
                    self._each(lambda c: c.update_weights_from_tensor([bucket]))
                else:
                    self._broadcast(bucket)
        finally:
            try:
                self._each(lambda c: c.end_weight_update())
            except Exception as e:  # noqa: BLE001 - keep the original error
                log.warning("closing the weight-update session: %s", e)
        self._each(lambda c: c.flush_cache())
        self._each(lambda c: c.update_weight_version(version))
        self.weight_version = version

    def _broadcast(self, bucket: List) -> None:
        """Announce ``bucket`` to every server and broadcast it; a refused announce aborts the wait (doc)."""
        fmt = weight_group.FLATTENED if weight_group.can_flatten(bucket) else None
        announces = [self._pool.submit(c.update_weights_from_distributed, bucket, self._group_name, fmt)
                     for c in self.clients]
        works = weight_group.broadcast_bucket_async(self._group, bucket, fmt)
        pause = 5e-5
        while not all(w.is_completed() for w in works):
            refused = [(c, f) for c, f in zip(self.clients, announces) if f.done() and f.exception() is not None]
            if refused:
                client, future = refused[0]
                self._group = None  # the pending broadcast can never complete: the group is unusable
                raise WeightTransportError(
                    f"{client.url} refused the weight bucket ({future.exception()}) while it was being broadcast; "
                    "the weight group is broken (servers that accepted may be stuck receiving): call "
                    "init_weight_sync again or restart the servers") from future.exception()
            time.sleep(pause)
            pause = min(2 * pause, 2e-3)
        for w in works:
            w.wait()
        for f in announces:
            f.result()

    # ---- lifecycle ---------------------------------------------------------------------------------

    def release_memory(self, tags: Optional[List[str]] = None) -> None:
        self._each(lambda c: c.release_memory_occupation(tags))

    def resume_memory(self, tags: Optional[List[str]] = None) -> None:
        self._each(lambda c: c.resume_memory_occupation(tags))

    def health(self) -> EngineHealth:
        ok = self._each(lambda c: c.health())
        bad = [c.url for c, good in zip(self.clients, ok) if not good]
        return EngineHealth(healthy=not bad, weight_version=self.weight_version,
                            detail=f"unhealthy: {bad}" if bad else "")

    def shutdown(self) -> None:
        """Stops this engine's threads; the servers belong to whoever launched them."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _settled(f: Future) -> Future:
    f.exception()  # wait for it, without raising yet
    return f
