"""The evaluation phase: held-out prompts through the rollout engines (current weights), scored by the
run's reward; ``pass@j`` (the unbiased estimator of Chen et al. 2021) and ``mean@n`` per dataset.

With one sample per prompt decoding is greedy by default, so ``eval/reward_mean`` is a noise-free
accuracy for exact-answer tasks. With ``eval.k`` = k > 1, n = ``eval.n_samples`` (>= k) samples per prompt
are drawn with the rollout's sampling; for a prompt with c passing samples pass@j = 1 − C(n−c, j)/C(n, j),
averaged over prompts, for j = 1, 2, 4, ..., k; ``mean@n`` is the mean reward of all samples.

Metric names: ``eval/<metric>`` over all datasets (prompt-weighted) and, with several datasets,
``eval/<name>/<metric>`` per dataset: ``reward_mean``, ``mean@n``, ``pass@j``, ``response_len_mean``,
``prompts``, ``reward_failed``.
"""

from __future__ import annotations

import math
from typing import Dict, List, Mapping, Sequence

from megatron_rl.config import EvalConfig
from megatron_rl.data.prompts import PromptDataset
from megatron_rl.orchestration.rollout_phase import RolloutPhase, request_seed

_EVAL_ROUND = 1 << 20  # seeds of eval requests never collide with a training round's


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c pass: 1 − C(n−c, k) / C(n, k) (as a stable product)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c={c} <= n={n} and 1 <= k={k} <= n")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def k_values(k: int) -> List[int]:
    """1, 2, 4, ... below k, and k."""
    out, j = [], 1
    while j < k:
        out.append(j)
        j *= 2
    return out + [k]


def group_metrics(rewards: Sequence[Sequence[float]], lengths: Sequence[int], k: int,
                  threshold: float) -> Dict[str, float]:
    """Metrics of one dataset from each prompt's sample rewards (all prompts with the same n)."""
    n = len(rewards[0])
    flat = [x for g in rewards for x in g]
    out = {"reward_mean": sum(flat) / len(flat), f"mean@{n}": sum(flat) / len(flat),
           "response_len_mean": sum(lengths) / len(lengths), "prompts": float(len(rewards))}
    for j in k_values(k):
        out[f"pass@{j}"] = sum(pass_at_k(n, sum(x >= threshold for x in g), j) for g in rewards) / len(rewards)
    return out


def combine(per_dataset: Mapping[str, Dict[str, float]]) -> Dict[str, float]:
    """``eval/...`` (prompt-weighted over datasets, failures summed) plus ``eval/<name>/...`` when several."""
    out: Dict[str, float] = {}
    total = sum(m["prompts"] for m in per_dataset.values())
    for key in next(iter(per_dataset.values())):
        values = [(m[key], m["prompts"]) for m in per_dataset.values()]
        if key in ("prompts", "reward_failed"):
            out[f"eval/{key}"] = float(sum(v for v, _ in values))
        else:
            out[f"eval/{key}"] = sum(v * w for v, w in values) / total
    if len(per_dataset) > 1:
        for name, m in per_dataset.items():
            out.update({f"eval/{name}/{k}": v for k, v in m.items()})
    return out


class Evaluator:
    def __init__(self, cfg: EvalConfig, datasets: Mapping[str, PromptDataset], phase: RolloutPhase, seed: int):
        self.cfg, self.datasets, self.phase, self.seed = cfg, dict(datasets), phase, seed

    def run(self, step: int) -> Dict[str, float]:
        """The step's ``eval/*`` metrics."""
        return combine(self.evaluate(step))

    def evaluate(self, step: int) -> Dict[str, Dict[str, float]]:
        """Per dataset name, its metrics (unprefixed)."""
        return {name: self._dataset(i, name, ds, step) for i, (name, ds) in enumerate(self.datasets.items())}

    def _dataset(self, index: int, name: str, dataset: PromptDataset, step: int) -> Dict[str, float]:
        cfg = self.cfg
        n = cfg.samples_per_prompt
        greedy = n == 1 if cfg.greedy is None else cfg.greedy
        records = dataset.records(range(min(cfg.max_prompts, len(dataset))))
        params = [self.phase.sampling(n=n, greedy=greedy, max_new_tokens=cfg.max_new_tokens,
                                      seed=request_seed(self.seed, step, _EVAL_ROUND + index, i))
                  for i in range(len(records))]
        samples = self.phase.generate(records, params, desc=f"eval {name} step {step}")
        groups, stats = self.phase.score(records, samples)
        out = group_metrics([g.rewards for g in groups], [len(s.response_ids) for g in groups for s in g.samples],
                            cfg.k, cfg.pass_threshold)
        out["reward_failed"] = stats.get("reward/failed", 0.0)
        return out
