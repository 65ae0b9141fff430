"""``profile.steps``: torch-profiler captures of chosen steps on the chosen trainer ranks and the engines."""

from __future__ import annotations

import logging
import os
from typing import Optional

from megatron_rl.config import RunConfig
from megatron_rl.metrics import PhaseTimer
from megatron_rl.orchestration import ray_waits
from megatron_rl.orchestration.trainer_group import TrainerGroup

logger = logging.getLogger(__name__)


class Profiler:
    def __init__(self, cfg: RunConfig, trainers: TrainerGroup, engines: list, timer: PhaseTimer):
        """``engines``: the engine workers launched here."""
        self.cfg, self.trainers, self.engines, self.timer = cfg, trainers, engines, timer
        self._profiling: Optional[int] = None  # the step a capture runs for

    def start(self, step: int) -> None:
        p = self.cfg.profile
        if step not in p.steps:
            return
        d = p.step_dir(self.cfg.output_dir, step)
        opts = dict(record_shapes=p.record_shapes, with_stack=p.with_stack)
        with self.timer.phase("profile"):
            self.trainers.start_profile(p.trainer_ranks, lambda r: os.path.join(d, f"trainer_rank{r}.json"), **opts)
            if p.engines:
                ray_waits.get([e.start_profile.remote(os.path.join(d, f"engine{i}"), **opts)
                               for i, e in enumerate(self.engines)], ray_waits.SHORT_S, "starting the engine profilers")
        self._profiling = step

    def stop(self, step: int) -> None:
        if self._profiling != step:
            return
        p = self.cfg.profile
        with self.timer.phase("profile"):
            self.trainers.stop_profile(p.trainer_ranks)
            if p.engines:
                ray_waits.get([e.stop_profile.remote() for e in self.engines], ray_waits.SHORT_S,
                              "stopping the engine profilers")
        self._profiling = None
        logger.info("step %d: profiler traces in %s", step, p.step_dir(self.cfg.output_dir, step))
