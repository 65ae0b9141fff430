"""Score a batch of responses: ``RewardRunner(config).compute_rewards(responses, labels)``.

A sample whose reward raised, timed out, returned something that is not a number (a string such as
"1.0" included) or not a finite float32 (1e300 would overflow the float32 advantages), or whose worker
died is *failed*: it gets ``config.failure_reward``, ``failed=True`` and a reason, is counted in the
stats and logged — and the batch completes. Only a broken set-up (a ``custom_fn`` that cannot be
imported: ``ValueError`` at construction; workers that cannot start: ``RuntimeError``) raises.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from tqdm.auto import tqdm

from megatron_rl.data.rewards.builtin import reward_value
from megatron_rl.data.rewards.config import RewardConfig
from megatron_rl.data.rewards.label_types import LabelTypeWatch
from megatron_rl.data.rewards.pool import Outcome, RewardWorkerPool
from megatron_rl.data.rewards.resolve import build_reward_fn

logger = logging.getLogger(__name__)

FAILURE_KINDS = ("exception", "timeout", "non_finite", "worker_died")
FLOAT32_MAX = 3.4028234663852886e38


@dataclass
class RewardResult:
    """Per-sample rewards of one batch, in input order.

    rewards: the reward, ``failure_reward`` where ``failed`` (a per-token reward's sum).
    token_rewards: per sample, the per-token rewards when the function returned a list, else None.
    reasons: ``None`` for a scored sample, else ``"<kind>: <detail>"`` with kind in :data:`FAILURE_KINDS`.
    stats:   ``reward/mean``, ``reward/failed``, ``reward/failed_<kind>``, ``reward/time_s``, ... (floats)
    """

    rewards: List[float]
    failed: List[bool]
    reasons: List[Optional[str]]
    stats: Dict[str, float]
    token_rewards: Optional[List[Optional[Tuple[float, ...]]]] = None


class RewardRunner:
    """Runs ``config``'s reward over batches, in worker processes (default) or in-process.

    Use as a context manager, or call :meth:`close`, to stop the workers. ``total_samples`` and
    ``total_failed`` accumulate over the runner's life.
    """

    def __init__(self, config: RewardConfig):
        self.config = config
        # Resolving here makes a bad custom_fn a ValueError now, in the caller, not a worker start-up error.
        self._fn = build_reward_fn(config)
        self._pool: Optional[RewardWorkerPool] = None if config.in_process else RewardWorkerPool(config)
        self.total_samples = 0
        self.total_failed = 0
        self._label_types = LabelTypeWatch(config.kind)

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def compute_rewards(self, responses: Sequence[str], labels: Sequence[Any],
                        sample_infos: Optional[Sequence[Mapping[str, Any]]] = None) -> RewardResult:
        """Score ``responses[i]`` against ``labels[i]``; ``sample_infos[i]`` (e.g. a record's metadata)
        is passed to the reward function as keyword arguments."""
        n = len(responses)
        if len(labels) != n or (sample_infos is not None and len(sample_infos) != n):
            raise ValueError(f"compute_rewards: {n} responses, {len(labels)} labels"
                             + (f", {len(sample_infos)} sample_infos" if sample_infos is not None else "")
                             + "; expected one of each per sample")
        self._label_types.check(labels)
        infos = [dict(x) for x in sample_infos] if sample_infos is not None else [{} for _ in range(n)]
        tasks = list(zip(responses, labels, infos))
        start = time.perf_counter()
        with tqdm(total=n, desc="rewards", unit="sample", leave=False,
                  disable=n < self.config.progress_min_batch) as bar:
            if self._pool is None:
                outcomes = [self._run_in_process(t, bar) for t in tasks]
            else:
                outcomes = self._pool.run(tasks, on_done=lambda _i: bar.update(1))
        result = self._collect(outcomes, time.perf_counter() - start)
        self._log_failures(result)
        return result

    def _run_in_process(self, task: tuple, bar: Any) -> Outcome:
        response, label, info = task
        try:
            outcome = Outcome(value=reward_value(self._fn(response, label, info)))
        except Exception as exc:
            outcome = Outcome(kind="exception", error=f"{type(exc).__name__}: {exc}")
        bar.update(1)
        return outcome

    def _collect(self, outcomes: List[Outcome], elapsed: float) -> RewardResult:
        rewards: List[float] = []
        reasons: List[Optional[str]] = []
        per_token: List[Optional[Tuple[float, ...]]] = []
        for o in outcomes:
            values = o.value if isinstance(o.value, tuple) else (o.value,)
            if o.kind is None and not all(math.isfinite(v) for v in values):  # type: ignore[arg-type]
                o = Outcome(kind="non_finite", error=f"reward function returned {o.value!r}")
            elif o.kind is None and any(abs(v) > FLOAT32_MAX for v in values):  # type: ignore[arg-type]
                # rewards become float32 advantages: 1e300 would turn into inf, then NaN advantages
                o = Outcome(kind="non_finite", error=f"reward function returned {o.value!r}, beyond float32 "
                                                     f"(|r| <= {FLOAT32_MAX:.3g})")
            reasons.append(None if o.kind is None else f"{o.kind}: {o.error}")
            per_token.append(o.value if o.kind is None and isinstance(o.value, tuple) else None)
            rewards.append(self.config.failure_reward if o.kind is not None else float(sum(values)))  # type: ignore[arg-type]
        failed = [r is not None for r in reasons]
        kinds = Counter(r.split(":", 1)[0] for r in reasons if r is not None)
        n = len(outcomes)
        stats = {
            "reward/mean": sum(rewards) / n if n else 0.0,
            "reward/failed": float(sum(failed)),
            "reward/failed_frac": sum(failed) / n if n else 0.0,
            "reward/time_s": elapsed,
        }
        stats.update({f"reward/failed_{k}": float(kinds.get(k, 0)) for k in FAILURE_KINDS})
        if self._pool is not None:
            stats["reward/worker_restarts"] = float(self._pool.restarts)
        self.total_samples += n
        self.total_failed += sum(failed)
        return RewardResult(rewards, failed, reasons, stats, per_token if any(t is not None for t in per_token) else None)

    def _log_failures(self, result: RewardResult) -> None:
        n_failed = sum(result.failed)
        if not n_failed:
            return
        first = next(r for r in result.reasons if r is not None)
        by_kind = {k: int(result.stats[f"reward/failed_{k}"]) for k in FAILURE_KINDS
                   if result.stats[f"reward/failed_{k}"]}
        logger.warning("%d of %d rewards failed %s (set to %s); first: %s", n_failed, len(result.rewards),
                       by_kind, self.config.failure_reward, first)


def compute_rewards(responses: Sequence[str], labels: Sequence[Any], config: RewardConfig,
                    sample_infos: Optional[Sequence[Mapping[str, Any]]] = None) -> RewardResult:
    """One-off scoring with a temporary runner (starts and stops workers: use a ``RewardRunner`` in loops)."""
    with RewardRunner(config) as runner:
        return runner.compute_rewards(responses, labels, sample_infos)
