"""Engine health: with ``rollout.recovery`` and engines launched here, the :class:`EngineMonitor` restarts dead
or hung engines, re-syncs them (``resync``) and re-admits them; a failure it gave up on stops the next rollout."""

from __future__ import annotations

import logging
from typing import Callable, Dict, Optional

from megatron_rl.config import RunConfig
from megatron_rl.orchestration import hooks
from megatron_rl.orchestration.engine_health import ActorEngine, EngineMonitor
from megatron_rl.rollout.client.balancer import RemoteEngine

logger = logging.getLogger(__name__)


class EngineHealth:
    def __init__(self, cfg: RunConfig, engine: RemoteEngine, actors: list, resync: Callable[[int, str], str]):
        """``actors``: the engine workers launched here (none: remote servers, which nobody here can restart)."""
        self.engine = engine
        self.monitor: Optional[EngineMonitor] = None
        r = cfg.rollout
        if not (r.recovery.enabled and actors):
            return
        if r.transport == "ipc":  # a restarted server would need the GPUs the trainer holds, and new IPC groups
            logger.warning("rollout.recovery: not available with the ipc weight transport (colocated SGLang); "
                           "a dead engine stops the run (resume=true continues from the last checkpoint)")
            return
        handles = [ActorEngine(a, i) for i, a in enumerate(actors)]
        self.monitor = EngineMonitor(engine, handles, resync, r.recovery).start()

    def before_rollout(self, step: int) -> None:
        if self.monitor is not None:
            self.monitor.raise_if_failed()
            hooks.fire("rollout", step=step, engine=self.engine, monitor=self.monitor)

    def metrics(self) -> Dict[str, float]:
        return self.monitor.metrics() if self.monitor is not None else {}

    def stop(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
