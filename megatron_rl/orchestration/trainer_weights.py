"""A trainer rank's side of weight sync (mixed into :class:`~megatron_rl.orchestration.trainer_worker.TrainerWorker`,
whose ``__init__`` sets the state): rank 0 drives the engines over HTTP (and hosts the distributed transport's weight
group); every rank joins the WeightSync's gathers."""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

import ray
import torch.distributed as dist

from megatron_rl.parallel import default_backend
from megatron_rl.rollout.client.balancer import RemoteEngine
from megatron_rl.rollout.client.http_client import SGLangClient
from megatron_rl.rollout.client.ipc_transport import IpcTransport
from megatron_rl.routing.align import expert_layout
from megatron_rl.weights.sync import WeightSync, WeightSyncError
from megatron_rl.weights.transactional_sync import TransactionalSync, supports_transactions


class TrainerWeights:
    """connect_engines, sync_weights, sync_engine, check_weights of TrainerWorker."""

    def connect_engines(self, urls: List[str], transport: str, policy: str, timeout_s: float = 600.0,
                        pause_mode: Optional[str] = None, control_timeout_s: float = 30.0) -> None:
        """Rank 0: a RemoteEngine over ``urls`` (and, for the distributed transport, the weight group it
        hosts); every rank: the WeightSync that joins rank 0's gathers (``ipc``: and its IpcTransport).
        ``pause_mode="retract"`` (partial rollouts): each sync holds the engines' running requests around the
        update and they are prefilled again under the new weights."""
        self._transport = transport
        self._group_timeout_s = timeout_s
        self._ipc = None
        if transport == "ipc":
            self._ipc = IpcTransport(urls, timeout_s=timeout_s)  # collective: every rank
        if self.rank == 0:
            layout = None
            if self.spec.weight_sync.replay_routing:  # the probe check asks the engines for their routing
                layout = expert_layout(self.trainer.built.arch)
            clients = [SGLangClient(u, timeout_s=timeout_s, expert_layout=layout, control_timeout_s=control_timeout_s)
                       for u in urls]
            self.engine = RemoteEngine(clients, policy=policy, weight_transport=transport, pause_mode=pause_mode)
            self._init_weight_group(self.engine)
        kind = TransactionalSync if supports_transactions(transport) else WeightSync  # stage/verify/commit per engine
        self.sync = kind(self.trainer.built, self.engine, self.spec.weight_sync, transport=self._ipc)
        if self.rank == 0:
            self.sync.progress = self.reporter

    def _init_weight_group(self, engine) -> None:
        """The distributed transport's weight group over ``engine``'s servers, hosted here (rank 0)."""
        if engine.weight_transport != "distributed":
            return

        engine.init_weight_sync(ray.util.get_node_ip_address(), 0, backend=self.spec.backend or default_backend(),
                                timeout_s=self._group_timeout_s)

    def _on_rank0(self, fn) -> None:
        """Collective: run ``fn`` on rank 0 and raise on every rank if it failed (no rank left in a later gather)."""
        error = None
        if self.rank == 0:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - re-raised below, after every rank knows
                error = e
        box = [None if error is None else f"{type(error).__name__}: {error}"]
        if self.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        if error is not None:
            raise error
        if box[0] is not None:
            raise WeightSyncError(f"weight sync set-up failed on rank 0: {box[0]}")

    def sync_weights(self, version: Any, check: Optional[bool] = None):
        if self._regroup:  # a restarted server is not in the weight group, or a failed broadcast broke it
            self._on_rank0(lambda: self._init_weight_group(self.engine))
            self._regroup = False
        try:
            stats = self.sync.sync(version, check=check)
        except Exception:
            self._regroup = self._transport == "distributed"
            raise
        return stats if self.rank == 0 else None

    def sync_engine(self, index: int, url: str, version: Any):
        """Collective: engine ``index`` was restarted at ``url``; give that server alone the current weights (and the
        probe check, if configured). The full weight group, if any, lacks the new server: it is rebuilt at the next
        :meth:`sync_weights`."""
        self._regroup = self._transport == "distributed"
        engines = []

        def connect():
            self.engine.replace_server(index, url)
            engines.append(self.engine.subset([index]))
            self._init_weight_group(engines[0])

        try:
            self._on_rank0(connect)
            config = dataclasses.replace(self.spec.weight_sync, progress=False)
            stats = WeightSync(self.trainer.built, engines[0] if engines else None, config).sync(version)
        finally:
            for engine in engines:
                engine.close_weight_sync()
                engine.shutdown()
        return stats if self.rank == 0 else None

    def check_weights(self, what: str = "(start-up: engines loaded from the checkpoint the trainer loaded)"):
        check = self.sync.check(what=what)
        return check if self.rank == 0 else None
