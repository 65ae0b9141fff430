"""RemoteEngine's weight updates (mixed into :class:`~megatron_rl.rollout.client.balancer.RemoteEngine`).

Weight updates go to every server inside SGLang's weight-update session (``/begin_weight_update`` on every
server first: SGLang refuses updates outside one, and a refused announce would leave the broadcast below
waiting forever; ``/end_weight_update`` on every server after the last bucket, also after a failure), then
one ``/flush_cache`` and the version. With ``pause_mode="in_place"`` (partial rollouts) the whole update runs
inside ``/pause_generation`` ... ``/continue_generation``: running requests are held between two decode steps,
take the new weights and version, and go on (SGLang records the version change on them: the response's
``weight_versions`` spans say which tokens each version produced). SGLang refuses the flush while requests are
held (their KV cache is in use), so then it is skipped; a server with nothing held is flushed. Two transports:

* ``"tensor"``: ``/update_weights_from_tensor`` with the embedded server's safetensors formats (embedded
  servers only).
* ``"distributed"``: ``/update_weights_from_distributed`` + a broadcast on a process group this engine
  hosts as rank 0 (SGLang's protocol; gloo on CPU, nccl on GPU), one ``flattened_bucket`` buffer per
  bucket. Call ``init_weight_sync`` first: it reads each server's TP size from ``/server_info`` (engine
  ranks are ``rank_offset + tp_rank``). SGLang answers an announce only after it has received the bucket,
  so acceptance is established beforehand (the session, the group); an announce refused anyway is
  noticed while the broadcast is pending, which is then abandoned with the server's message (the group
  is marked broken and rebuilt by the next ``init_weight_sync``) -- never a silent hang.

(``"ipc"``, colocated engines, is collective over the trainer ranks -- each sends its own GPU's copy --
so it is not this engine's: ``rollout/client/ipc_transport.py``; such an engine serves generation and checks.)
"""

from __future__ import annotations

import logging
import secrets
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterable, List

from megatron_rl.rollout.client.http_client import RequestRejected, SGLangClient
from megatron_rl.weights import group as weight_group
from megatron_rl.weights.receiver import NamedTensorBucket

log = logging.getLogger("megatron_rl.rollout.client.balancer")  # RemoteEngine's log, as before the split


class WeightTransportError(RuntimeError):
    """A server refused a weight bucket while the trainer was broadcasting it; the group is unusable."""


def settled(f: Future) -> Future:
    f.exception()  # wait for it, without raising yet
    return f


class RemoteWeights:
    """Weight sync set-up, updates and versions over every server; the state (clients, pool, group) is
    RemoteEngine's."""

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
        store = self._store
        if not (master_port and store is not None and (store.host, store.port) == (master_address, master_port)):
            # a fixed port keeps its store: a broken group may still hold it, and the port is bound once
            store = self._store = weight_group.host_store(master_address, world, timeout_s, port=master_port)
        port = store.port
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
        self._group, self._group_name = group, name
        self._group_args = dict(master_address=master_address, master_port=master_port, backend=backend,
                                timeout_s=timeout_s, group_name=group_name)
        log.info("weight group %r: trainer rank 0 + %d engine ranks (TP sizes %s)", name, world - 1, sizes)

    @property
    def weight_sync_ready(self) -> bool:
        """The ``distributed`` transport's weight group exists (not yet built, or broken by a failed broadcast)."""
        return self._group is not None

    def close_weight_sync(self) -> None:
        """Leave the weight group (servers and trainer side)."""
        self._destroy_group()

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
        except RequestRejected:
            if self.pause_mode is None:
                raise
            log.debug("%s holds paused requests: cache not flushed (SGLang refuses while they are held)", client.url)

    def _start_bucket(self, bucket: List) -> Callable[[], None]:
        """Start sending ``bucket`` to every server; returns the call that waits for it (and raises its error)."""
        if self.weight_transport == "tensor":
            futures = [self._pool.submit(c.update_weights_from_tensor, [bucket]) for c in self.clients]

            def finish() -> None:
                for f in [settled(f) for f in futures]:
                    f.result()
            return finish
        fmt = weight_group.FLATTENED if weight_group.can_flatten(bucket) else None
        announces = [self._pool.submit(c.update_weights_from_distributed, bucket, self._group_name, fmt)
                     for c in self.clients]
        works = weight_group.broadcast_bucket_async(self._group, bucket, fmt)
        return lambda: self._finish_broadcast(announces, works)

    def _finish_broadcast(self, announces: List[Future], works: List) -> None:
        """Wait for a bucket's broadcast; a refused announce aborts the wait (module doc)."""
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
