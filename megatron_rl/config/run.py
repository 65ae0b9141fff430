"""The run's config tree: one typed :class:`RunConfig` composing every component's own section.

A recipe (YAML) mirrors the tree; any field can be overridden on the command line with a dotted
``key=value`` (``rollout.n_samples_per_prompt=8``). :func:`megatron_rl.preflight.load_run_config` reads,
merges, prepares generated assets (the tiny recipe's model, tokenizer and data), builds (each section
validates itself on construction, errors name the dotted path) and then runs the cross-field rules of
:mod:`megatron_rl.config.checks` (batch divisibility, parallel sizes vs world size, paths) with its own checks
of what the config points at (files, vocabulary vs tokenizer, checkpoints), reporting every problem at once,
each with the fields, their values and a fix.

Each component receives only its section: the trainer ``model``/``train``/``optim``, the reward
runner ``reward``, the sampler ``data``, the engines ``rollout``. Nothing threads the whole tree.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Literal, Mapping, Optional

from megatron_rl import config_io
from megatron_rl.config.objective import DenseKLConfig, ObjectiveConfig
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.config.sections import AdvantageConfig, DiagnosticsConfig, ModelConfig, ParallelLayout, ProfileConfig
from megatron_rl.config.train import OptimConfig, TrainConfig
from megatron_rl.data.config import DataConfig
from megatron_rl.data.rewards.config import RewardConfig
from megatron_rl.launch.slurm import SlurmConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelConfig:
    """Trainer processes and how the model is split over them (data parallelism is the rest)."""

    world_size: int = 1  # trainer processes (one per GPU on GPU machines)
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: Optional[int] = None  # expert tensor parallelism (None: same as tp)
    cp: int = 1  # context parallelism: every sequence split over cp ranks (zigzag), for long contexts

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "ep", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name}={getattr(self, name)} must be >= 1")

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(tp=self.tp, pp=self.pp, ep=self.ep, cp=self.cp, etp=self.etp)

    @property
    def model_parallel(self) -> int:
        """Ranks of one data-parallel replica: tp * pp * cp."""
        return self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        return self.world_size // self.model_parallel


@dataclass(frozen=True)
class WarmupConfig:
    """Imitation warm-up: the first ``steps`` steps train on the dense KL to ``teacher`` only (advantages
    zero, no dynamic-sampling filter), then the RL objective takes over. ``teacher`` (an HF directory)
    becomes ``train.reference_model``."""

    steps: int = 0
    teacher: Optional[str] = None
    dense_kl: DenseKLConfig = field(default_factory=lambda: DenseKLConfig(beta=1.0, sparse_includes_future_kl=False))

    def objective(self, base: ObjectiveConfig) -> ObjectiveConfig:
        return dataclasses.replace(base, dense_kl=self.dense_kl)


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation on held-out prompts through the rollout engines (after the weight sync), scored by the
    run's reward: ``pass@j`` (unbiased estimator, j = 1, 2, 4, ..., k) and ``mean@n`` per dataset.

    datasets:       name -> prompts; metrics ``eval/<name>/...`` per dataset (with more than one) and
                    ``eval/...`` over all of them (prompt-weighted). ``data``: one unnamed dataset (an alias).
    k:              pass@k with up to k; ``n_samples`` (>= k, default k) samples per prompt.
    greedy:         None: greedy decoding when one sample per prompt, else the rollout's sampling.
    pass_threshold: a sample passes when its reward is >= this.
    """

    data: Optional[DataConfig] = None
    datasets: Dict[str, DataConfig] = field(default_factory=dict)
    interval: int = 0  # steps between evaluations (0: never); also before the first and after the last step
    max_prompts: int = 256  # per dataset
    k: int = 1
    n_samples: Optional[int] = None
    greedy: Optional[bool] = None
    pass_threshold: float = 1.0
    max_new_tokens: Optional[int] = None  # None: rollout.sampling.max_new_tokens

    def __post_init__(self) -> None:
        if self.data is not None and self.datasets:
            raise ValueError("eval.data and eval.datasets are both set: eval.data is the one-dataset alias; name it "
                             "in eval.datasets instead")
        if self.k < 1 or self.samples_per_prompt < self.k:
            raise ValueError(f"eval.k={self.k} must be >= 1 and eval.n_samples={self.n_samples} >= k (the unbiased "
                             "pass@k estimator needs n >= k samples per prompt)")
        if self.greedy and self.samples_per_prompt > 1:
            raise ValueError(f"eval.greedy=true with {self.samples_per_prompt} samples per prompt (eval.k / "
                             "eval.n_samples): greedy samples are all the same; set eval.greedy=null")

    @property
    def samples_per_prompt(self) -> int:
        return self.k if self.n_samples is None else self.n_samples

    @property
    def named_datasets(self) -> Dict[str, DataConfig]:
        return {"eval": self.data} if self.data is not None else dict(self.datasets)


@dataclass(frozen=True)
class CheckpointSection:
    """Trainer checkpoints (``training/checkpoint.py``) plus the driver's state; HF export at the end."""

    root: Optional[str] = None  # None: <logging.output_dir>/checkpoints
    interval: int = 0  # steps between checkpoints (0: only at the end)
    keep_last: int = 3
    save_optimizer: bool = True
    optimizer_format: str = "fully_reshardable"
    save_hf: bool = True  # write <output_dir>/hf_final (safetensors) at the end
    # SIGTERM/SIGINT (SLURM preemption, `timeout`, Ctrl-C): finish the step, checkpoint it, then stop (a second
    # signal stops at once). false: stop at once, like Ctrl-C; the latest checkpoint is where resume=true starts
    on_signal: bool = False


@dataclass(frozen=True)
class LoggingConfig:
    output_dir: str = "runs/default"
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "megatron-rl"
    wandb_run_name: Optional[str] = None
    jsonl: bool = True
    progress: bool = True  # bars: rollout requests, rewards, train/forward micro-batches, weight sync (+ its own switch)
    print_samples: int = 1  # responses printed per step (0: none)
    # warn when this many steps in a row changed nothing (no batch, a skipped or an all-zero gradient); 0: never
    warn_no_update_steps: int = 10


def check_stall_bounds(warn_s: Any, fail_s: Any) -> None:
    for name, v in (("stall_warn_s", warn_s), ("stall_fail_s", fail_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
            raise ValueError(f"cluster.{name}={v!r}: expected a finite number of seconds > 0")
    if fail_s < warn_s:
        raise ValueError(f"cluster.stall_fail_s={fail_s!r} < cluster.stall_warn_s={warn_s!r}: a silent trainer rank is "
                         "warned about first, then the run stops; set stall_fail_s >= stall_warn_s")


@dataclass(frozen=True)
class ClusterConfig:
    """Ray: where to run and what each worker reserves."""

    address: Optional[str] = None  # None: start a local Ray; "auto": the cluster of RAY_ADDRESS (SLURM)
    num_cpus: Optional[float] = None  # local Ray only: logical CPUs (None: enough for every worker)
    cpus_per_trainer: float = 1.0
    gpus_per_trainer: float = 0.0
    cpus_per_engine: float = 1.0
    gpus_per_engine: float = 0.0  # disaggregated SGLang: rollout.sglang.tp_size
    threads_per_worker: int = 1  # torch intra-op threads in each worker (OMP_NUM_THREADS)
    backend: Optional[str] = None  # torch.distributed backend (None: nccl with CUDA, else gloo)
    # trainer heartbeats (orchestration/heartbeat.py): a rank silent this long is named in a warning, and after
    # stall_fail_s the run stops (resume=true continues from the last committed checkpoint)
    stall_warn_s: float = 60.0
    stall_fail_s: float = 600.0

    def __post_init__(self) -> None:
        check_stall_bounds(self.stall_warn_s, self.stall_fail_s)


@dataclass(frozen=True)
class PrepareConfig:
    """Assets generated before the config is checked (deterministic, no downloads; skipped when present)."""

    kind: Literal["none", "tiny_arithmetic"] = "none"
    dir: str = "runs/assets"
    seed: int = 0
    # tiny_arithmetic: dense, the MoE variant (8 experts, top-2) or the DeepSeek-V3-style one (MLA, shared expert)
    model: Literal["qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe"] = "qwen3"


@dataclass
class RunConfig:
    """Everything one ``megatron-rl train`` run needs. Only ``model`` and ``data`` are required."""

    model: ModelConfig
    data: DataConfig
    seed: int = 0
    steps: int = 100
    stop_after_steps: Optional[int] = None  # stop early (e.g. end of a SLURM slot); resume=true continues
    resume: bool = False
    resume_step: Optional[int] = None  # resume from this checkpoint step instead of the latest (implies resume)
    overwrite: bool = False  # start over even if the output dir holds checkpoints (they are deleted)
    tokenizer: Optional[str] = None  # None: model.hf_path
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)  # torch-profiler traces of chosen steps
    slurm: Optional[SlurmConfig] = None  # read by `megatron-rl slurm`; ignored by the run itself

    @staticmethod
    def normalize_keys(mapping: Mapping[str, Any]) -> Dict[str, Any]:
        """What some keys imply, filled in before the sections are built (config_io applies it): ``resume_step``
        implies ``resume``; ``warmup.teacher`` is the trainer's reference model (its logits feed the dense KL)
        unless ``train.reference_model`` is given."""
        out = dict(mapping)
        if out.get("resume_step") is not None:
            out["resume"] = True
        warmup, train = out.get("warmup"), out.get("train")
        teacher = warmup.get("teacher") if isinstance(warmup, Mapping) else getattr(warmup, "teacher", None)
        reference = train.get("reference_model") if isinstance(train, Mapping) else getattr(train, "reference_model", None)
        if teacher is not None and reference is None and isinstance(train, (Mapping, type(None))):
            model = out.get("model")
            model = dict(model) if isinstance(model, Mapping) else config_io.to_dict(model)
            out["train"] = {**(train or {}), "reference_model": {**model, "hf_path": teacher}}
        return out

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be >= 1")
        if self.resume_step is not None and self.resume_step < 0:
            raise ValueError(f"resume_step={self.resume_step} must be a checkpoint step >= 0")
        teacher, ref = self.warmup.teacher, self.train.reference_model
        if teacher is not None and ref is not None and ref.hf_path != teacher:
            raise ValueError(f"warmup.teacher={teacher!r} and train.reference_model.hf_path={ref.hf_path!r} "
                             "differ: the warm-up teacher is the trainer's reference model; set only one")

    # ---- derived views, so components get their own part -------------------------------------------
    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model.hf_path

    @property
    def output_dir(self) -> str:
        return self.logging.output_dir

    @property
    def checkpoint_root(self) -> str:
        return self.checkpoint.root or os.path.join(self.logging.output_dir, "checkpoints")

    @property
    def last_step(self) -> int:
        """The step this invocation stops after."""
        return min(self.steps, self.stop_after_steps or self.steps)

    def objective_at(self, step: int) -> ObjectiveConfig:
        """The objective of (1-based) ``step``: the warm-up's for the first ``warmup.steps`` steps."""
        if step <= self.warmup.steps:
            return self.warmup.objective(self.train.objective)
        return self.train.objective
