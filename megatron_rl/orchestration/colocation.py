"""Colocated placement: the order in which engines and trainer hand each GPU to each other.

SGLang frees and re-maps its memory by tag (``--enable-memory-saver``; ``srt/managers/scheduler_components/
weight_updater.py release_memory_occupation / resume_memory_occupation``): ``weights``, ``kv_cache``,
``cuda_graph``. The order below is slime's and verl's, and the only one that works:

1. after the rollout (engines idle): the engines release everything, then the trainer takes its
   optimizer state and gradient buffers back from host memory (:meth:`Colocation.to_training`);
2. after training: the trainer offloads them again, the engines resume ``weights`` (a weight update
   writes into that memory: updating released weights would write into unmapped memory), the weights
   are synced, then the engines resume ``kv_cache`` and ``cuda_graph``, and only then does the probe
   check run -- it generates, which needs the KV cache (:meth:`Colocation.sync`);
3. a checkpoint needs the optimizer state on the GPU: the idle engines release ``kv_cache`` and
   ``cuda_graph`` (not their weights, which would then need a re-sync) while it is saved
   (:meth:`Colocation.trainer_state_loaded`).

Resident memory at each hand-over comes back as metrics: ``memory/train/*`` (after the trainer took its
state back; ``gpu_peak_allocated_gib``: training's peak), ``memory/sync/*`` (after it offloaded) and
``memory/rollout/*`` (engines back; on GPU ``gpu_device_used_gib`` counts the engine's memory too).
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Tuple

WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"  # SGLang's memory tags (srt/constants.py)


class Colocation:
    """``engine``: the driver's ``RemoteEngine`` (``release_memory`` / ``resume_memory`` by tags);
    ``trainers``: the ``TrainerGroup`` (``offload``, ``reload``, ``memory``, ``sync_weights``,
    ``check_weights``); ``timer``: the run's ``PhaseTimer``; ``offload_trainer``: move the trainer's
    optimizer state and gradient buffers to host memory while the engines hold the GPU."""

    def __init__(self, engine, trainers, timer, *, offload_trainer: bool, check: bool):
        self.engine, self.trainers, self.timer = engine, trainers, timer
        self.offload_trainer, self.check = offload_trainer, check
        self.released = False  # the engines gave their memory to the trainer

    def start(self) -> None:
        """Before the first rollout: the trainer's state goes to host memory."""
        if self.offload_trainer:
            self.trainers.offload()

    def to_training(self) -> Dict[str, float]:
        with self.timer.phase("engine_memory"):
            self.engine.release_memory()  # all tags
        self.released = True
        if not self.offload_trainer:
            return {}
        with self.timer.phase("trainer_memory"):
            return self.trainers.reload()

    def sync(self, version: Any) -> Tuple[Any, Dict[str, float]]:
        """The weight sync with the hand-over around it; returns its ``SyncStats`` and memory metrics."""
        memory: Dict[str, float] = {}
        if self.offload_trainer:
            with self.timer.phase("trainer_memory"):
                memory.update(self.trainers.offload())
        with self.timer.phase("engine_memory"):
            self.engine.resume_memory([WEIGHTS])
        with self.timer.phase("weight_sync"):
            stats = self.trainers.sync_weights(version, False)
        with self.timer.phase("engine_memory"):
            self.engine.resume_memory([KV_CACHE, CUDA_GRAPH])
        self.released = False
        if self.check:
            with self.timer.phase("weight_sync"):
                stats.check = self.trainers.check_weights(f"after syncing version {version}")
        memory.update(self.trainers.memory("memory/rollout/"))
        return stats, memory

    def resume(self) -> None:
        """Whatever the engines still hold released comes back (nothing, after :meth:`sync`)."""
        if self.released:
            with self.timer.phase("engine_memory"):
                self.engine.resume_memory()
            self.released = False

    @contextlib.contextmanager
    def trainer_state_loaded(self):
        if not self.offload_trainer:
            yield
            return
        with self.timer.phase("trainer_memory"):
            self.engine.release_memory([KV_CACHE, CUDA_GRAPH])
            self.trainers.reload()
        try:
            yield
        finally:
            with self.timer.phase("trainer_memory"):
                self.trainers.offload()
                self.engine.resume_memory([KV_CACHE, CUDA_GRAPH])
