"""The phases of a run, each an object that owns its state; :class:`~megatron_rl.orchestration.run.Run` builds
them at start-up and the loop (``driver.py``) calls them.

  training.py     TrainingPhase: the step's plan (objective, passes), log-probs, advantages, train, gain
  publish.py      WeightPublisher: weight sync to the engines, colocated memory hand-over, sync retries
  health.py       EngineHealth: the engine monitor (restart, re-sync, re-admit) and its fault-injection point
  checkpoint.py   Checkpointer: restore (or the step-0 check) at start-up, the trainer + driver state per step
  evaluation.py   EvalPhase: held-out evaluation when due
  profile.py      Profiler: torch-profiler captures of chosen steps
  step_log.py     StepLog: the step's metrics line (timings, throughput, MFU) and console summary

The rollout phase (generate -> rewards -> filter) and the rollout modes are ``orchestration/rollout.py``,
``modes.py`` and ``async_rollout.py``.
"""
