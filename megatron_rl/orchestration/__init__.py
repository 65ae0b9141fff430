"""Ray orchestration of a run: trainer ranks and rollout engines as actors, and the driver loop.

  trainer_worker.py  TrainerWorker: one PolicyTrainer rank (torch.distributed + Megatron), weight sync
                     (rank 0 drives it over HTTP), checkpoints
  engine_worker.py   EngineWorker: an SGLang server (GPU) or our embedded server (CPU), returns its URL
  placement.py       Ray start-up; placement groups for colocated / disaggregated runs
  trainer_group.py   TrainerGroup: one call -> every rank, data-parallel shards in, one result out
  rollout.py         rollout -> rewards -> dynamic-sampling filter with over-sampling; seeds
  batching.py        samples -> TrainBatch; the advantages phase; log-prob agreement metrics
  evaluate.py        held-out evaluation through the engines: pass@k (unbiased) and mean@k per dataset
  eval_cli.py        ``megatron-rl eval RECIPE_OR_HF_DIR``: the same evaluation, stand-alone
  run.py             Run: a run's resources (start-up, resume, tear-down) and its phases
  driver.py          train(cfg): the loop, one named call per phase
  cli.py             ``megatron-rl train RECIPE [key=value ...] [--dry-run]``

Nothing here is imported by ``megatron_rl`` itself: Ray is only loaded by a run.
"""
