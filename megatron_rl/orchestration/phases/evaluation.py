"""The evaluation phase of a step: due every ``eval.interval`` steps and at the last; nothing without eval data."""

from __future__ import annotations

from typing import Dict, Mapping

from megatron_rl.config import RunConfig
from megatron_rl.data.prompts import PromptDataset
from megatron_rl.metrics import PhaseTimer
from megatron_rl.orchestration.evaluate import Evaluator
from megatron_rl.orchestration.rollout_phase import RolloutPhase


class EvalPhase:
    def __init__(self, cfg: RunConfig, datasets: Mapping[str, PromptDataset], rollouts: RolloutPhase,
                 timer: PhaseTimer):
        self.cfg, self.timer = cfg, timer
        self.evaluator = Evaluator(cfg.eval, datasets, rollouts, cfg.seed) if datasets else None

    def due(self, step: int) -> bool:
        e = self.cfg.eval
        return self.evaluator is not None and e.interval > 0 and (step % e.interval == 0 or step == self.cfg.steps)

    def at(self, step: int) -> Dict[str, float]:
        """The step's ``eval/*`` metrics when an evaluation is due, else none."""
        if not self.due(step):
            return {}
        with self.timer.phase("eval"):
            return self.evaluator.run(step)
