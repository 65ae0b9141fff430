"""megatron_rl: RL post-training of LLMs on Megatron-Core with vocabulary-sharded losses.

Tour (each sub-package's ``__init__`` has its own):
  ops/            vocabulary-parallel autograd Functions (log-probs, entropy, sum pi^2, DVP, exact KL)
  objectives/     pure loss functions over typed per-token records (PPO/GSPO, corrections, TRM, DVP, KL)
  advantages/     GRPO/Dr.GRPO, RLOO, REINFORCE++, OTB, return-to-go
  models/         HF config -> Megatron GPTModel (dense, MoE), layer specs, HF <-> Megatron weights,
                  MoE routing record / replay
  training/       the trainer (PolicyTrainer): micro-batches, pipeline, optimizer, checkpoints
  routing/        MoE rollout routing: engine routes -> trainer layout, agreement metrics
  rollout/        engines: client/ (SGLang protocol, HTTP client, balancer, launcher) and embedded/ (our
                  engine and its SGLang-compatible server)
  weights/        trainer -> engine weight transport: group, per-rank links, payloads, sync + probe check
  data/           prompt datasets, sampler, rewards in sandboxed workers, the tiny arithmetic task
  orchestration/  Ray workers and placement, the driver loop and its phases, rollout modes, recovery
  launch/         SLURM sbatch rendering, Ray cluster helpers
  bench/          ``megatron-rl bench``: synthetic-workload throughput runs, sweeps, their tables and plots
  plan/           ``megatron-rl plan``: the step-time cost model, device table, calibration, ranking
  cli/            ``megatron-rl <command>``: one module per sub-command
  config/         the typed run config (no torch): sections, the rollout section's key aliases, loading, checks
  yaml_safe.py    the bounded YAML loader (depth, aliases, duplicate keys, huge integers, encoding)
  preflight.py    the checked loader: config, files and the output folder before anything starts
  run_dir.py, pids.py  one run per output folder (lock), nothing of a previous run overwritten
  config_io.py    dataclass <-> YAML / dotted overrides, type-checked, every problem at once
  lr_schedules.py learning-rate schedules incl. the response-length-surge decay
  parallel.py     torch.distributed + Megatron parallel_state set-up; explicit process groups
  compat/         the CPU compatibility layer for Megatron-Core (applied only without CUDA)
  metrics.py, perf.py, profiling.py   metric sinks; throughput, idle fractions, MFU; torch-profiler captures
  diagnostics.py  the gain decomposition of an update (math_spec §h) and reward bits per episode (§i)
  upstream_warnings.py  known Megatron-Core / torch warnings as one line (the command line installs it)
  report.py       the plots of ``megatron-rl report RUN_DIR`` (one HTML page of PNGs)
  export.py       any trainer checkpoint -> HF directory (``megatron-rl export``)
"""

__version__ = "0.1.0"
