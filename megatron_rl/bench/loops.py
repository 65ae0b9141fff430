"""The bench's one-sided loops (``--mode trainer`` and ``--mode engine``) over a run's own phase objects
(:class:`megatron_rl.orchestration.run.Run`: the same trainers, engines, timers and metrics line as a training run;
``--mode full`` is :func:`megatron_rl.orchestration.driver.train` itself).

* ``engine``: each step is rollout -> rewards only (``run.batches.next_batch``): no trainer pass and no weight
  sync, so the engines generate with the same weights all along and every step times generation alone.
* ``trainer``: one batch is generated before the first step (untimed, the workload's drawn lengths) and each
  step trains on it: log-probs, advantages, train (and the gain diagnostic's forward where the recipe has it on);
  no rollout and no weight sync. Colocated engines give their
  memory to the trainer once, before the first step, and take it back after the last.

Both run the rollout in ``sync`` mode (the bench sets it): with one side alone there is nothing to overlap.
"""

from __future__ import annotations

from megatron_rl.config import RunConfig
from megatron_rl.orchestration.batching import train_batch
from megatron_rl.orchestration.run import Run

MODES = ("full", "trainer", "engine")


def engine_only(cfg: RunConfig) -> None:
    with Run(cfg) as run:
        for step in range(1, cfg.last_step + 1):
            batch = run.batches.next_batch(step)
            run.log.write(step, dict(batch.metrics), batch)


def trainer_only(cfg: RunConfig) -> None:
    with Run(cfg) as run:
        batch = run.batches.next_batch(1)
        if batch.skipped:
            raise RuntimeError(f"--mode trainer: the rollout gave no batch to train on ({batch.skipped})")
        run.publisher.release_engines()  # colocated: once, for every step
        run.timer.finish_step()  # the rollout and the hand-over are not any step's time
        run.rollouts.meter.since_last()
        for step in range(1, cfg.last_step + 1):
            plan = run.training.plan(step)
            tb, fwd, metrics = run.training.logprobs(train_batch(batch.groups, run.cluster.routing), plan)
            tb, m_adv = run.training.advantages(tb, fwd, batch, plan)
            metrics.update(m_adv, **run.training.train(tb, plan))
            metrics.update(run.training.gain(tb, batch, plan))  # diagnostics.gain: its forward, as in a run
            run.log.write(step, metrics)
        run.publisher.resume_engines()
