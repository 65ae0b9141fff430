"""``RemoteEngine``: the ``RolloutEngine`` protocol over one or more HTTP servers (SGLang or embedded).

Requests are spread over servers by ``policy``: ``"round_robin"`` or ``"least_outstanding"`` (the
server with the fewest requests in flight from this engine; ties go round-robin). A request's ``n``
samples go to one server (prefix sharing). This is an in-process balancer; ``sglang-router`` (a separate
process) can sit in front of the servers instead, in which case give ``RemoteEngine`` the router's URL.

Engine recovery (``orchestration/engine_health.py`` sets ``on_failure``): a request whose server cannot be
reached (``ServerUnavailableError``: refused, reset, no answer) takes that server out of rotation, is
reported to ``on_failure(index, error)`` and is re-sent to another available server -- or waits for one
when none is left -- at most ``max_resends`` times. The monitor puts a server back with
:meth:`RemoteEngine.set_available` (it was fine) or :meth:`RemoteEngine.replace_server` (restarted at a
new URL). Without ``on_failure`` a failure is raised as before.

Weight updates go to every server inside SGLang's weight-update session (``/begin_weight_update`` on every
server first: SGLang refuses updates outside one, and a refused announce would leave the broadcast below
waiting forever; ``/end_weight_update`` on every server after the last bucket, also after a failure), then
one ``/flush_cache`` and the version. With a ``pause_mode`` the whole update runs inside ``/pause_generation``
... ``/continue_generation``: running requests are held between two decode steps, take the new weights and
version, and go on (SGLang records the version change on them: the response's ``weight_versions`` spans say
which tokens each version produced). ``"retract"`` (partial rollouts) frees the held requests' KV cache and
prefills them again under the new weights, keeping their tokens and log-probs, so the flush succeeds and no KV
of old weights survives the sync. ``"in_place"`` keeps that KV, and SGLang then refuses the flush (the prefix
cache keeps old-weights KV for later requests): such a refusal is logged and counted in ``flush_refused``.
Without a pause mode a refused flush raises. Two transports:

* ``"tensor"``: ``/update_weights_from_tensor`` with the embedded server's safetensors formats (embedded
  servers only).
* ``"distributed"``: ``/update_weights_from_distributed`` + a broadcast on a process group this engine
  hosts as rank 0 (SGLang's protocol; gloo on CPU, nccl on GPU), one ``flattened_bucket`` buffer per
  bucket. Call ``init_weight_sync`` first: it reads each server's TP size from ``/server_info`` (engine
  ranks are ``rank_offset + tp_rank``). SGLang answers an announce only after it has received the bucket,
  so acceptance is established beforehand (the session, the group); an announce refused anyway is
  noticed while the broadcast is pending, which is then abandoned with the server's message (the group
  is marked broken and rebuilt by the next ``init_weight_sync``) -- never a silent hang
  (``weight_group_host.py``).

(``"ipc"``, colocated engines, is collective over the trainer ranks -- each sends its own GPU's copy --
so it is not this engine's: ``rollout/client/ipc_transport.py``; such an engine serves generation and checks.)
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

from megatron_rl.rollout.client.transactional import TransactionalUpdates
from megatron_rl.rollout.client.weight_group_host import WeightGroupHost
from megatron_rl.weights import group as weight_group
from megatron_rl.rollout.client.http_client import RequestRejected, SGLangClient, ServerUnavailableError
from megatron_rl.rollout.client.protocol import EngineHealth, GenerateRequest, RolloutEngine, Sample
from megatron_rl.weights.receiver import NamedTensorBucket

log = logging.getLogger(__name__)

POLICIES = ("round_robin", "least_outstanding")
PAUSE_MODES = (None, "retract", "in_place")
TRANSPORTS = ("tensor", "distributed", "ipc")


class RemoteEngine(TransactionalUpdates, WeightGroupHost, RolloutEngine):
    def __init__(self, clients: Sequence[SGLangClient], policy: str = "least_outstanding",
                 weight_transport: str = "tensor", max_concurrency: int = 64, max_resends: int = 3,
                 pause_mode: Optional[str] = None):
        if not clients:
            raise ValueError("RemoteEngine needs at least one SGLangClient")
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: expected one of {POLICIES}")
        if weight_transport not in TRANSPORTS:
            raise ValueError(f"weight_transport={weight_transport!r}: expected one of {TRANSPORTS}")
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode={pause_mode!r}: expected one of {PAUSE_MODES}")
        self.pause_mode = pause_mode
        self.clients = list(clients)
        self.policy, self.weight_transport = policy, weight_transport
        self.outstanding = [0] * len(self.clients)
        self._rr = itertools.cycle(range(len(self.clients)))
        self._lock = threading.Lock()
        # recovery (module doc): which servers take requests, and who hears about unreachable ones
        self.available = [True] * len(self.clients)
        self._cv = threading.Condition(self._lock)
        self.on_failure: Optional[Callable[[int, BaseException], None]] = None
        self.max_resends = max_resends
        self.resent = [0] * len(self.clients)  # requests re-sent because server i could not be reached
        self.flush_refused = [0] * len(self.clients)  # syncs after which server i kept its prefix cache
        self._fatal: Optional[BaseException] = None
        self._progress = [0.0] * len(self.clients)  # last time server i answered a request or became busy
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="rollout-http")
        self._group = None
        self._group_generation = 0
        self._group_args: Optional[dict] = None
        self._store = None  # the weight group's store, hosted here on the master address only
        self.weight_version = "default"

    def _pick(self) -> Tuple[int, SGLangClient]:
        """An available server (waiting for one while none is) and its client; counts the request on it."""
        with self._cv:
            while not any(self.available):
                if self._fatal is not None:
                    raise self._fatal
                self._cv.wait()
            n = len(self.clients)
            start = next(self._rr)  # round-robin, or the starting point that spreads least-outstanding ties
            order = [j for j in ((start + k) % n for k in range(n)) if self.available[j]]
            i = order[0] if self.policy == "round_robin" else min(order, key=lambda j: self.outstanding[j])
            if self.outstanding[i] == 0:
                self._progress[i] = time.monotonic()
            self.outstanding[i] += 1
            return i, self.clients[i]

    def _run_one(self, req: GenerateRequest) -> List[Sample]:
        resends = 0
        while True:
            i, client = self._pick()
            try:
                samples = client.generate_one(req)
            except ServerUnavailableError as e:
                if self.on_failure is None or resends >= self.max_resends:
                    raise
                self._report(i, client, e)
                resends += 1
                with self._lock:
                    self.resent[i] += 1
                log.debug("request re-sent (%d/%d): %s", resends, self.max_resends, e)
                continue
            finally:
                with self._lock:
                    self.outstanding[i] -= 1
                    self._progress[i] = time.monotonic()
            return samples

    # ---- availability (engine recovery, module doc) ------------------------------------------------

    def _report(self, i: int, client: SGLangClient, error: BaseException) -> None:
        """Server ``i`` could not be reached through ``client``: out of rotation, and tell ``on_failure``."""
        with self._cv:
            if self.clients[i] is not client or not self.available[i]:
                return  # already out, or replaced since this request was sent: nothing new to report
            self.available[i] = False
        if self.on_failure is not None:
            self.on_failure(i, error)

    def set_available(self, i: int, available: bool) -> None:
        with self._cv:
            self.available[i] = available
            self._progress[i] = time.monotonic()
            self._cv.notify_all()

    def replace_server(self, i: int, url: str) -> None:
        """Server ``i`` now answers at ``url`` (a restarted engine); it takes requests again."""
        with self._cv:
            self.clients[i] = self.clients[i].with_url(url)
        self.set_available(i, True)

    def stalled(self, i: int, seconds: float) -> bool:
        """Requests are in flight on server ``i`` and it has answered none for ``seconds``."""
        with self._lock:
            return self.outstanding[i] > 0 and time.monotonic() - self._progress[i] > seconds

    def fail(self, error: BaseException) -> None:
        """Requests waiting for an available server raise ``error`` (recovery gave up)."""
        with self._cv:
            self._fatal = error
            self._cv.notify_all()

    def generate(self, requests: Sequence[GenerateRequest]) -> List[Sample]:
        futures = [self._pool.submit(self._run_one, r) for r in requests]
        return [s for f in futures for s in f.result()]

    def _each(self, fn) -> List[Any]:
        """Run ``fn(client)`` on every server concurrently; re-raise the first failure (after all finished)."""
        futures = [self._pool.submit(fn, c) for c in self.clients]
        return [f.result() for f in [_settled(f) for f in futures]]

    def _each_available(self, fn) -> None:
        """``_each`` over the available servers; with ``on_failure``, an unreachable one is reported, not raised."""
        if self.on_failure is None:
            self._each(fn)
            return
        with self._lock:
            targets = [(i, c) for i, c in enumerate(self.clients) if self.available[i]]
        futures = [(i, c, self._pool.submit(fn, c)) for i, c in targets]
        for i, c, f in futures:
            error = _settled(f).exception()
            if isinstance(error, ServerUnavailableError):
                self._report(i, c, error)
            elif error is not None:
                raise error

    def subset(self, indices: Sequence[int]) -> "RemoteEngine":
        """A RemoteEngine over servers ``indices`` (their clients, this one's settings), e.g. to sync weights to a
        restarted server alone; ``shutdown`` it (and ``close_weight_sync``) when done."""
        return RemoteEngine([self.clients[i] for i in indices], self.policy, self.weight_transport)

    def prompt_logprobs(self, token_ids: Sequence[int]) -> List[Any]:
        """One ``[L - 1]`` tensor per server, in ``clients`` order (each server is checked on its own)."""
        return self._each(lambda c: c.prompt_logprobs(token_ids))

    def prompt_logprobs_and_routes(self, token_ids: Sequence[int]) -> List[Any]:
        """Per server: ``([L - 1] log-probs, [L, moe layers, topk] routes)`` of the same scoring."""
        return self._each(lambda c: c.prompt_logprobs_and_routes(token_ids))

    # ---- weights -----------------------------------------------------------------------------------

    def update_weights(self, named_tensor_buckets: Iterable[NamedTensorBucket], version: Any) -> None:
        version = str(version)
        if self.weight_transport == "ipc":
            raise RuntimeError("weight_transport='ipc' is collective over the trainer ranks (each sends its own "
                               "GPU's copy): sync through WeightSync with an ipc_transport.IpcTransport")
        if self.weight_transport == "distributed" and self._group is None:
            raise RuntimeError("weight_transport='distributed' needs init_weight_sync(...) first" +
                               (" (the last sync broke the group)" if self._group_args else ""))
        if self.pause_mode is not None:
            self._each(lambda c: c.pause_generation(self.pause_mode))
        try:
            pending = None
            try:
                self._each(lambda c: c.begin_weight_update())
                # bucket k + 1 is produced (the trainer's collectives, in this thread) while bucket k is on its
                # way; the servers still receive one bucket at a time, in order
                for bucket in named_tensor_buckets:
                    bucket = list(bucket)
                    if pending is not None:
                        pending, previous = None, pending
                        previous()
                    pending = self._start_bucket(bucket)
                if pending is not None:
                    pending, previous = None, pending
                    previous()
            finally:
                if pending is not None:  # an error while producing the next bucket: let this one land first
                    try:
                        pending()
                    except Exception as e:  # noqa: BLE001 - keep the original error
                        log.warning("finishing the weight bucket in flight: %s", e)
                try:
                    self._each(lambda c: c.end_weight_update())
                except Exception as e:  # noqa: BLE001 - keep the original error
                    log.warning("closing the weight-update session: %s", e)
            self._each(self._flush)
            self.update_weight_version(version)
        finally:
            if self.pause_mode is not None:
                self._each(lambda c: c.continue_generation())

    def update_weight_version(self, version: Any) -> None:
        """Relabel the weights every server holds (SGLang records the change on running requests)."""
        self._each(lambda c: c.update_weight_version(str(version)))
        self.weight_version = str(version)

    def _flush(self, client: SGLangClient) -> None:
        try:
            client.flush_cache()
        except RequestRejected as e:
            if self.pause_mode is None:
                raise
            with self._lock:  # by url: a transaction calls through a copy of the client (its own deadline)
                i = [c.url for c in self.clients].index(client.url)
                self.flush_refused[i] += 1
            log.warning("%s refused /flush_cache after the weight update (%s): its prefix cache keeps KV computed by "
                        "the old weights for the requests that follow (%d such syncs; pause_mode=%r -- 'retract' "
                        "avoids it)", client.url, e, self.flush_refused[i], self.pause_mode)

    def _start_bucket(self, bucket: List) -> Callable[[], None]:
        """Start sending ``bucket`` to every server; returns the call that waits for it (and raises its error)."""
        if self.weight_transport == "tensor":
            futures = [self._pool.submit(c.update_weights_from_tensor, [bucket]) for c in self.clients]

            def finish() -> None:
                for f in [_settled(f) for f in futures]:
                    f.result()
            return finish
        fmt = weight_group.FLATTENED if weight_group.can_flatten(bucket) else None
        announces = [self._pool.submit(c.update_weights_from_distributed, bucket, self._group_name, fmt)
                     for c in self.clients]
        works = weight_group.broadcast_bucket_async(self._group, bucket, fmt)
        return lambda: self._finish_broadcast(announces, works)

    # ---- lifecycle ---------------------------------------------------------------------------------

    def release_memory(self, tags: Optional[List[str]] = None) -> None:
        self._each_available(lambda c: c.release_memory_occupation(tags))

    def resume_memory(self, tags: Optional[List[str]] = None) -> None:
        self._each_available(lambda c: c.resume_memory_occupation(tags))

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
