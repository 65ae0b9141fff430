"""The RL loop: one named call per phase (the phases live in :mod:`megatron_rl.orchestration.run`).

    rollout -> rewards -> dynamic-sampling filter        run.batches.next_batch (per rollout.mode, modes.py)
    old / reference log-probs                            run.logprobs
    advantages                                           run.advantages
    train                                                run.train
    weight sync                                          run.sync_weights, between run.batches.before/after_publish
    evaluation, checkpoint, metrics line                 run.evaluate, run.checkpoint, run.log

``rollout.mode``: ``sync`` generates each batch when its step starts; ``one_step`` generates the next step's
batch while this step trains (one step stale); ``async`` generates continuously under the
``rollout.max_staleness`` bound, pausing in-flight generations in place across the weight sync with
``rollout.partial``. The decoupled loss and rollout correction account for the staleness, token by token.
Colocated engines hand their memory to the trainer between the rollout and the sync.
"""

from __future__ import annotations

import logging
from typing import Dict, List

from megatron_rl.config import RunConfig
from megatron_rl.orchestration.batching import train_batch
from megatron_rl.orchestration.run import Run

logger = logging.getLogger(__name__)


def train(cfg: RunConfig) -> List[Dict[str, float]]:
    """Run ``cfg`` from its start (or its latest checkpoint with ``resume``); returns the step metrics."""
    history: List[Dict[str, float]] = []
    with Run(cfg) as run:
        first = {"time/startup": run.startup_seconds}
        if run.start_step == 0 and cfg.eval.interval:
            history.append(run.log(0, {**first, **run.evaluate(0)}))  # the baseline, before any update
            first = {}
        for step in range(run.start_step + 1, cfg.last_step + 1):
            batch = run.batches.next_batch(step)  # rollout -> rewards -> dynamic-sampling filter
            metrics, first = {**first, **batch.metrics}, {}
            if batch.skipped:
                logger.warning("step %d skipped: %s", step, batch.skipped)
                metrics["train/skipped_empty_batch"] = 1.0
            else:
                run.release_engines()
                tb, fwd, m_logprobs = run.logprobs(train_batch(batch.groups, run.routing), step)
                tb, m_adv = run.advantages(tb, fwd, batch, step)
                metrics.update(m_logprobs, **m_adv, **run.train(tb, step))
            run.batches.before_publish(step)  # one_step: the next rollout is done; async: drained (or partial)
            run.resume_engines()
            if not batch.skipped:
                metrics.update(run.sync_weights(step))
            run.batches.after_publish(step, synced=not batch.skipped)
            metrics.update(run.evaluate(step))
            run.checkpoint(step)
            history.append(run.log(step, metrics, batch))
    return history
