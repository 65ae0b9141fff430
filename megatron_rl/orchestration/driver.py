"""The RL loop: one named call per phase (the phases live in :mod:`megatron_rl.orchestration.run`).

    rollout -> rewards -> dynamic-sampling filter        run.rollout (or the off-policy rollout started last step)
    old / reference log-probs                            run.logprobs
    advantages                                           run.advantages
    train                                                run.train
    weight sync                                          run.sync_weights
    evaluation, checkpoint, metrics line                 run.evaluate, run.checkpoint, run.log

With ``rollout.off_policy=1`` the next step's rollout is started before this step trains and is waited
for before the weight sync, so it runs on the previous weights while the trainer works (one step
stale; the decoupled loss and rollout correction account for it). Colocated engines hand their memory
to the trainer between the rollout and the sync.
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
        pending = run.pending
        for step in range(run.start_step + 1, cfg.last_step + 1):
            run.profile_start(step)  # profile.steps: torch-profiler traces of this step
            batch = pending or run.rollout(step)  # rollout -> rewards -> dynamic-sampling filter
            next_rollout = run.rollout_async(step + 1)  # off-policy: overlaps this step's training
            metrics, first = {**first, **batch.metrics}, {}
            if batch.skipped:
                logger.warning("step %d skipped: %s", step, batch.skipped)
                metrics["train/skipped_empty_batch"] = 1.0
            else:
                run.release_engines()
                tb, fwd, m_logprobs = run.logprobs(train_batch(batch.groups, run.routing), step)
                tb, m_adv = run.advantages(tb, fwd, batch, step)
                metrics.update(m_logprobs, **m_adv, **run.train(tb, step))
                metrics.update(run.gain(tb, batch, step))  # diagnostics.gain: a forward under the new weights
            pending = run.wait(next_rollout)
            run.resume_engines()
            if not batch.skipped:
                metrics.update(run.sync_weights(step))
            metrics.update(run.evaluate(step))
            run.checkpoint(step, pending)
            run.profile_stop(step)
            history.append(run.log(step, metrics, batch))
    return history
