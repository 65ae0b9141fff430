"""The ``distributed`` weight transport's group, hosted by a RemoteEngine as rank 0 (mixed into
:class:`~megatron_rl.rollout.client.balancer.RemoteEngine`, whose ``__init__`` sets the state): the servers join
it as SGLang's ``init_custom_process_group`` does; each bucket is announced to every server and broadcast, and a
refused announce abandons the pending broadcast with the server's message instead of hanging (module doc of
``balancer.py``)."""

from __future__ import annotations

import logging
import secrets
import time
from concurrent.futures import Future
from typing import List

from megatron_rl.weights import group as weight_group

log = logging.getLogger("megatron_rl.rollout.client.balancer")  # RemoteEngine's log, as before the split


class WeightTransportError(RuntimeError):
    """A server refused a weight bucket while the trainer was broadcasting it; the group is unusable."""


class WeightGroupHost:
    """init_weight_sync / close_weight_sync and the broadcast's wait, for RemoteEngine."""

    def init_weight_sync(self, master_address: str, master_port: int = 0, backend: str = "gloo",
                         timeout_s: float = 300.0, group_name: str = "megatron_rl_weights") -> None:
        """Host the weight group as rank 0; server ``i`` joins with ``rank_offset = 1 + sum of the TP sizes of
        servers before it`` (its TP ranks are ``rank_offset + tp_rank``; sizes from ``/server_info``).
        ``master_port=0``: a port the OS picks, bound before any server is told about it (recommended).
        Calling it again replaces the group (after a server restart, or a broken broadcast)."""
        self._destroy_group()
        infos = self._each(lambda c: c.server_info())
        for c, info in zip(self.clients, infos):
            # SGLang's engine rank is rank_offset + tp_rank (model_runner_components/weight_updater.py): the
            # pipeline stages of one server would take the same ranks
            if int(info.get("pp_size") or 1) > 1:
                raise ValueError(f"weight_transport='distributed' supports servers with tensor parallelism only; "
                                 f"{c.url} reports pp_size={info.get('pp_size')} (its pipeline stages would collide "
                                 "on the weight group's ranks): start it with --pp-size 1 or use "
                                 "weight_transport='tensor'")
        sizes = [int(info.get("tp_size", 1)) for info in infos]
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

    def _finish_broadcast(self, announces: List[Future], works: List, deadline=None, clients=None) -> None:
        """Wait for a bucket's broadcast; a refused announce aborts the wait (module doc); so does ``deadline``
        (a :class:`~megatron_rl.weights.deadline.Deadline`: ``SyncTimeout``). ``clients``: whom ``announces`` went to."""
        clients = self.clients if clients is None else clients
        pause = 5e-5
        while not all(w.is_completed() for w in works):
            if deadline is not None:
                deadline.check("stage (broadcast)")
            refused = [(c, f) for c, f in zip(clients, announces) if f.done() and f.exception() is not None]
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
            f.result(timeout=None if deadline is None else max(deadline.remaining(), 0.0))
