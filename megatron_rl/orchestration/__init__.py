"""Ray orchestration of a run: trainer ranks and rollout engines as actors, and the driver loop.

  trainer_worker.py  TrainerWorker: one PolicyTrainer rank (torch.distributed + Megatron), weight sync
                     (rank 0 drives it over HTTP), checkpoints
  trainer_weights.py a trainer rank's side of weight sync (engines, weight group, re-sync of a restarted one)
  engine_worker.py   EngineWorker: an SGLang server (GPU) or our embedded server (CPU) as its child process:
                     URL, exit status, kill, restart on a fresh port
  engine_health.py   EngineMonitor: dead or hung engines restarted, re-synced, re-admitted after the probe check
  placement.py       Ray start-up; placement groups for colocated / disaggregated runs
  colocation.py      Colocation: who holds each GPU when (SGLang memory tags, trainer offload, memory metrics)
  trainer_group.py   TrainerGroup: one call -> every rank, data-parallel shards in, one result out
  rollout_phase.py   rollout -> rewards -> dynamic-sampling filter with over-sampling; seeds
  modes.py           rollout.mode: where each step's batch comes from (sync, one_step; async_rollout.py)
  async_rollout.py   async: a continuous prompt stream under the staleness bound, partial rollouts
  staleness.py       the staleness bound kept by admission; staleness metrics
  activity.py        engine / trainer idle fractions
  batching.py        samples -> TrainBatch; the advantages phase; log-prob agreement metrics
  evaluate.py        held-out evaluation through the engines: pass@k (unbiased) and mean@k per dataset
  evaluate_model.py  ``megatron-rl eval``'s work: the same evaluation of an HF model or recipe, stand-alone
  startup.py         a run's resources: data, reward workers, Ray, placement, trainer ranks, engines, clients
  phases/            the phase objects: training, weight publishing, engine health, checkpoints, evaluation,
                     profiling, the step's metrics line
  run.py             Run: builds the resources and the phases at start-up (resume or step-0 check), tears down
  progress.py        progress bars for work inside Ray actors (micro-batches, forwards, weight sync)
  failures.py        run failures the user can act on (the CLI prints them without a traceback)
  signals.py         SIGTERM / SIGINT (SLURM preemption, timeout, kill) stop a run the way Ctrl-C does
  ray_guard.py       a parent-death guard for a run's local Ray
  hooks.py           named points where tests inject faults (tests/fault_hooks.py registers them)
  driver.py          train(cfg): the loop, one named call per phase (``megatron-rl train``: megatron_rl.cli.train)

Nothing here is imported by ``megatron_rl`` itself: Ray is only loaded by a run.
"""
