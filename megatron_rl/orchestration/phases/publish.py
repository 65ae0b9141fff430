"""Weight publishing: the trainer's weights to the engines after each step (and the colocated hand-over of the
GPUs' memory around it), checked by the probe, retried when an engine died during the sync."""

from __future__ import annotations

import contextlib
import itertools
import logging
from typing import Dict, Optional

from megatron_rl.config import RunConfig
from megatron_rl.metrics import PhaseTimer
from megatron_rl.orchestration import hooks
from megatron_rl.orchestration.colocation import Colocation
from megatron_rl.orchestration.engine_health import EngineMonitor, EngineRecoveryError
from megatron_rl.orchestration.sync_failures import handle_failed_engines
from megatron_rl.orchestration.trainer_group import TrainerGroup

logger = logging.getLogger(__name__)


class WeightPublisher:
    def __init__(self, cfg: RunConfig, trainers: TrainerGroup, timer: PhaseTimer, colocation: Optional[Colocation]):
        self.cfg, self.trainers, self.timer, self.colocation = cfg, trainers, timer, colocation
        self.monitor: Optional[EngineMonitor] = None  # with engine recovery: set by attach_monitor
        self._release_hold = None  # the monitor's hold while colocated engines have released their memory

    def attach_monitor(self, monitor: Optional[EngineMonitor]) -> None:
        self.monitor = monitor

    def trainer_state_loaded(self):
        """Colocated: the trainer's offloaded state on its GPUs (checkpoints read and write it)."""
        return self.colocation.trainer_state_loaded() if self.colocation is not None else contextlib.nullcontext()

    def release_engines(self) -> Dict[str, float]:
        """Colocated: the engines free their memory for the trainer, which takes its state back (memory metrics).
        They get it back in :meth:`sync`."""
        if self.colocation is None:
            return {}
        if self.monitor is not None:  # released engines answer no /health; restarts wait for the resume
            self._release_hold = self.monitor.hold("memory released")
        metrics = self.colocation.to_training()
        hooks.fire("engines_released", monitor=self.monitor)
        return metrics

    def resume_engines(self) -> None:
        """Whatever the engines still hold released (nothing after a sync) comes back."""
        if self.colocation is not None:
            self.colocation.resume()
        if self._release_hold is not None:
            self._release_hold.release()
            self._release_hold = None

    def sync(self, step: int) -> Dict[str, float]:
        memory: Dict[str, float] = {}
        if self.colocation is not None and self.colocation.released and self.monitor is None:
            stats, memory = self.colocation.sync(step)  # the engines' memory comes back piece by piece around it
        else:
            self.resume_engines()  # with recovery: an engine answers /health only with all its memory back
            with self.timer.phase("weight_sync"):
                stats = self._sync(step)
        out = {"sync/seconds": stats.seconds, "sync/mib": stats.bytes / 2**20, "sync/buckets": float(stats.buckets),
               "sync/flush_refused": float(stats.flush_refused),  # > 0: a prefix cache kept old-weights KV (N1)
               **stats.link_metrics(prefix="sync/")}  # sync/link<r>/bytes, /gb_per_s: per sending trainer rank
        if stats.check is not None:
            out["sync/probe_max_abs_diff"] = stats.check.max_abs_diff
            out["sync/probe_mean_abs_diff"] = stats.check.mean_abs_diff
        out.update(handle_failed_engines(stats, self.monitor))  # sync/phase_seconds/..., sync/engines_..., sync/aborted
        return {**out, **memory}

    def _sync(self, version: int):
        """With recovery: after the engines out of rotation are back; a sync that failed because an engine died or
        hung is retried once it is recovered."""
        if self.monitor is None:
            return self.trainers.sync_weights(version=version)
        for attempt in itertools.count(1):
            self.monitor.wait_all_up()
            try:
                with self.monitor.hold("weight sync"):
                    hooks.fire("before_sync", version=version, monitor=self.monitor)
                    return self.trainers.sync_weights(version=version)
            except Exception as e:  # noqa: BLE001 - re-raised unless an engine failure explains it
                if isinstance(e, EngineRecoveryError) or attempt > self.cfg.rollout.recovery.max_restarts \
                        or not self.monitor.recover_all():
                    raise
                cause = getattr(e, "cause", None) or e  # a Ray task error: the trainer's exception
                logger.warning("weight sync v%s failed with an engine down (%s: %s); engines recovered, syncing again",
                               version, type(cause).__name__, (str(cause).strip().splitlines() or [""])[-1])

    def resync_engine(self, index: int, url: str) -> str:
        """Engine recovery: the trainer's current weights to the restarted engine ``index``, and the probe check."""
        stats = self.trainers.sync_engine(index, url)
        check = (f"probe max |dlogp| {stats.check.max_abs_diff:.2e}" if stats.check is not None
                 else "no probe check (rollout.weight_sync.check=false)")
        return f"weights v{stats.version} ({stats.bytes / 2**20:.1f} MiB), {check}"
