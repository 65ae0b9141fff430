"""The RL loop: one named call per phase (the phase objects live in :mod:`megatron_rl.orchestration.phases`).

    rollout -> rewards -> dynamic-sampling filter        run.batches.next_batch (per rollout.mode, modes.py)
    the step's objective and passes, worked out once     run.training.plan
    old / reference log-probs                            run.training.logprobs
    advantages                                           run.training.advantages
    train                                                run.training.train
    weight sync                                          run.publisher.sync, between run.batches.before/after_publish
    evaluation, checkpoint, metrics line                 run.evaluation.at, run.checkpoints.save, run.log.write

``rollout.mode``: ``sync`` generates each batch when its step starts; ``one_step`` generates the next step's
batch while this step trains (one step stale); ``async`` generates continuously under the
``rollout.max_staleness`` bound, pausing in-flight generations (retract) across the weight sync with
``rollout.partial``. The decoupled loss and rollout correction account for the staleness, token by token.
Colocated engines hand their memory to the trainer between the rollout and the sync, and take it back piece
by piece around the sync (``colocation.py``).

SIGTERM/SIGINT stop the loop (:mod:`.signals`: at once, or after checkpointing the step with
``checkpoint.on_signal``). The loop warns about steps that changed nothing (no batch, a skipped optimizer
step, an all-zero gradient) when they go on for ``logging.warn_no_update_steps`` steps, and about tokens
the loss had to leave out as non-finite. Tests inject faults at the points named in :mod:`.hooks`.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

from megatron_rl.config import RunConfig
from megatron_rl.orchestration import hooks
from megatron_rl.orchestration.batching import train_batch
from megatron_rl.orchestration.run import Run
from megatron_rl.orchestration.signals import Interrupted, StopSignals

logger = logging.getLogger(__name__)


def train(cfg: RunConfig) -> List[Dict[str, float]]:
    """Run ``cfg`` from its start (or its latest checkpoint with ``resume``); returns the step metrics.
    Raises :class:`~megatron_rl.orchestration.signals.Interrupted` when a signal stopped it."""
    history: List[Dict[str, float]] = []
    watch = NoUpdateWatch(cfg.logging.warn_no_update_steps)
    with StopSignals(cfg.checkpoint.on_signal) as stop, Run(cfg) as run:
        first = {"time/startup": run.startup_seconds}
        if run.start_step == 0 and cfg.eval.interval:
            history.append(run.log.write(0, {**first, **run.evaluation.at(0)}))  # the baseline, before any update
            first = {}
        for step in range(run.start_step + 1, cfg.last_step + 1):
            run.profiler.start(step)  # profile.steps: torch-profiler traces of this step
            batch = run.batches.next_batch(step)  # rollout -> rewards -> dynamic-sampling filter
            metrics, first = {**first, **batch.metrics}, {}
            if batch.skipped:
                logger.warning("step %d skipped: %s", step, batch.skipped)
                metrics["train/skipped_empty_batch"] = 1.0
            else:
                plan = run.training.plan(step)
                metrics.update(run.publisher.release_engines())
                tb, fwd, m_logprobs = run.training.logprobs(train_batch(batch.groups, run.cluster.routing), plan)
                tb, m_adv = run.training.advantages(tb, fwd, batch, plan)
                metrics.update(m_logprobs, **m_adv, **run.training.train(tb, plan))
                warn_numerics(step, metrics)
                metrics.update(run.training.gain(tb, batch, plan))  # diagnostics.gain: a forward under the new weights
            run.batches.before_publish(step)  # one_step: the next rollout is done; async: drained (or partial)
            if not batch.skipped:
                metrics.update(run.publisher.sync(step))  # colocated: also gives the engines their memory back
            run.publisher.resume_engines()
            run.batches.after_publish(step, synced=not batch.skipped)
            metrics.update(run.evaluation.at(step))
            stopping = stop.requested is not None
            saved = run.checkpoints.save(step, metrics, force=stopping)
            hooks.fire("after_checkpoint", step=step)
            run.profiler.stop(step)
            history.append(run.log.write(step, metrics, batch))
            watch.update(step, metrics)
            if stopping:
                raise Interrupted(stop.requested, checkpoint_step=step if saved else None)
    watch.summary()
    return history


def warn_numerics(step: int, m: Dict[str, float]) -> None:
    """A skipped optimizer step (with the run's step number, not the optimizer's) and tokens left out of the
    loss as non-finite."""
    if m.get("train/skipped"):
        why = ("the update made the weights non-finite; rolled back" if m.get("train/nonfinite_weights") else
               f"a non-finite loss or gradient, grad norm {m.get('train/grad_norm', float('nan')):.4g}")
        logger.warning("step %d: optimizer step skipped (%s); the weights are unchanged", step, why)
    bad = max(m.get("tokens/nonfinite", 0.0), m.get("train/nonfinite_policy_tokens", 0.0))
    if bad > 0:
        logger.warning("step %d: %d response token(s) had non-finite log-probs or advantages and were left out of the "
                       "loss (reward/failed_non_finite %d): check the reward function and the sampling settings",
                       step, bad, m.get("reward/failed_non_finite", 0.0))


class NoUpdateWatch:
    """Counts steps that changed no weight and warns when ``threshold`` of them come in a row."""

    def __init__(self, threshold: int):
        self.threshold = threshold
        self.streak: Optional[Tuple[int, int]] = None  # (first step, length)
        self.longest = (0, 0)  # (length, first step)
        self.total = self.steps = 0

    def update(self, step: int, m: Dict[str, float]) -> None:
        self.steps += 1
        idle = bool(m.get("train/skipped_empty_batch") or m.get("train/skipped")) or m.get("train/grad_norm") == 0.0
        if not idle:
            self.streak = None
            return
        self.total += 1
        start, length = self.streak or (step, 0)
        self.streak = (start, length + 1)
        self.longest = max(self.longest, (length + 1, start))
        if self.threshold and (length + 1) % self.threshold == 0:
            logger.warning("steps %d-%d: %d steps in a row changed no weight (no batch to train on, a skipped step or "
                           "an all-zero gradient; last mean reward %.3f): the rewards may be constant or equal within "
                           "every group; check the reward function and the data", start, step, length + 1,
                           m.get("rollout/reward_mean", float("nan")))

    def summary(self) -> None:
        length, start = self.longest
        if self.threshold and length >= self.threshold:
            logger.warning("%d of %d steps changed no weight (the longest run: %d steps from step %d)", self.total,
                           self.steps, length, start)
