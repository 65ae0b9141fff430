"""The evaluation phase: held-out prompts through the rollout engines (current weights), scored by the
run's reward. Greedy by default, so the number is a noise-free accuracy for exact-answer tasks."""

from __future__ import annotations

import statistics
from typing import Dict

from megatron_rl.config import EvalConfig
from megatron_rl.data.prompts import PromptDataset
from megatron_rl.orchestration.rollout import RolloutPhase, request_seed

_EVAL_ROUND = 1 << 20  # seeds of eval requests never collide with a training round's


class Evaluator:
    def __init__(self, cfg: EvalConfig, dataset: PromptDataset, phase: RolloutPhase, seed: int):
        self.cfg, self.dataset, self.phase, self.seed = cfg, dataset, phase, seed

    def run(self, step: int) -> Dict[str, float]:
        cfg = self.cfg
        records = self.dataset.records(range(min(cfg.max_prompts, len(self.dataset))))
        params = [self.phase.sampling(n=cfg.n_samples, greedy=cfg.greedy, max_new_tokens=cfg.max_new_tokens,
                                      seed=request_seed(self.seed, step, _EVAL_ROUND, i))
                  for i in range(len(records))]
        samples = self.phase.generate(records, params, desc=f"eval step {step}")
        groups, stats = self.phase.score(records, samples)
        rewards = [x for g in groups for x in g.rewards]
        lengths = [len(s.response_ids) for g in groups for s in g.samples]
        return {"eval/reward_mean": statistics.fmean(rewards),
                "eval/response_len_mean": statistics.fmean(lengths),
                "eval/prompts": float(len(records)),
                "eval/reward_failed": stats.get("reward/failed", 0.0)}
