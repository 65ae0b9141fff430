"""The run's config tree: one typed :class:`RunConfig` composing every component's own section.

A recipe (YAML) mirrors the tree; any field can be overridden on the command line with a dotted
``key=value`` (``rollout.n_samples_per_prompt=8``). :func:`build_run_config` builds (each section validates
itself on construction, errors name the dotted path); :func:`megatron_rl.preflight.load_run_config` reads,
merges, prepares generated assets (the tiny recipe's model, tokenizer and data), builds and then runs the
cross-section rules (``checks.py``: batch divisibility, parallel sizes vs world size, paths) with the checks
of what the config points at (data files, model directories, checkpoints, servers, vocabulary vs tokenizer),
reporting every problem at once, each with the fields, their values and a fix. This package imports no torch
and none of the packages that read it (models, training, ...).

  run.py      RunConfig and the run-level sections (parallel, warm-up, eval, checkpoint, logging, cluster)
  rollout.py  RolloutConfig and its sub-sections (engines, sampling, client, weights, overlap, recovery); the
              one table of its renamed (formerly flat) keys
  load.py     recipe + overrides -> RunConfig (unchecked); the resolved config as YAML
  checks.py   the rules across sections (imports no torch); megatron_rl/preflight.py checks what the
              config points at (files, model directories, checkpoints, servers) and loads a checked config

Each component receives only its section: the trainer ``model``/``train``/``optim``, the reward
runner ``reward``, the sampler ``data``, the engines ``rollout``. Nothing threads the whole tree.
"""

from megatron_rl.config.load import build_run_config, dump_yaml, resolve_mapping
from megatron_rl.config.rollout import (
    ALIASES,
    ClientConfig,
    EnginesConfig,
    OverlapConfig,
    RecoveryConfig,
    RolloutConfig,
    SamplingConfig,
    SGLangConfig,
    WeightsConfig,
)
from megatron_rl.config.run import (
    CheckpointSection,
    ClusterConfig,
    EvalConfig,
    LoggingConfig,
    ParallelConfig,
    PrepareConfig,
    RunConfig,
    WarmupConfig,
)

__all__ = [
    "ALIASES", "CheckpointSection", "ClientConfig", "ClusterConfig", "EnginesConfig", "EvalConfig", "LoggingConfig",
    "OverlapConfig", "ParallelConfig", "PrepareConfig", "RecoveryConfig", "RolloutConfig", "RunConfig",
    "SGLangConfig", "SamplingConfig", "WarmupConfig", "WeightsConfig", "build_run_config", "dump_yaml",
    "resolve_mapping",
]
