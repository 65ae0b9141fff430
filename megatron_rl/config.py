"""The run's config tree: one typed :class:`RunConfig` composing every component's own section.

A recipe (YAML) mirrors the tree; any field can be overridden on the command line with a dotted
``key=value`` (``rollout.n_samples_per_prompt=8``). :func:`load_run_config` reads, merges, builds (each
section validates itself on construction, errors name the dotted path), prepares generated assets
(the tiny recipe's model, tokenizer and data) and then runs the cross-field checks of
:mod:`megatron_rl.config_checks` — batch divisibility, parallel sizes vs world size, vocabulary vs
tokenizer, paths — reporting every problem at once, each with the fields, their values and a fix.

Each component receives only its section: the trainer ``model``/``train``/``optim``, the reward
runner ``reward``, the sampler ``data``, the engines ``rollout``. Nothing threads the whole tree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Mapping, Optional, Sequence

from megatron_rl import config_io
from megatron_rl.advantages import AdvantageConfig
from megatron_rl.data.config import DataConfig, deferred_path_checks
from megatron_rl.data.rewards.config import RewardConfig
from megatron_rl.diagnostics import DiagnosticsConfig
from megatron_rl.launch.slurm import SlurmConfig
from megatron_rl.models.config import ModelConfig
from megatron_rl.objectives import DenseKLConfig, ObjectiveConfig
from megatron_rl.parallel import ParallelLayout
from megatron_rl.profiling import ProfileConfig
from megatron_rl.weights.config import WeightSyncConfig
from megatron_rl.training.config import OptimConfig, TrainConfig

logger = logging.getLogger(__name__)
ROLLOUT_MODES = ("sync", "one_step", "async")


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
class SamplingConfig:
    """Rollout sampling (SGLang names). The tokenizer's EOS is always a stop token."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 1024
    stop_token_ids: List[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        problems = []
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            problems.append(f"temperature={self.temperature} must be a finite number >= 0")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p} must be in (0, 1] (1 keeps every token)")
        if self.top_k == 0 or self.top_k < -1:
            problems.append(f"top_k={self.top_k} must be -1 (off) or >= 1")
        if not 0 <= self.min_p < 1:
            problems.append(f"min_p={self.min_p} must be in [0, 1) (0 is off)")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if any(t < 0 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids={self.stop_token_ids} must be token ids >= 0")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def filtered(self) -> bool:
        return self.top_k != -1 or self.top_p < 1.0 or self.min_p > 0.0


@dataclass(frozen=True)
class SGLangConfig:
    """How each SGLang server is launched (``rollout.engine: sglang``); see ``rollout/client/sglang.py``."""

    tp_size: int = 1  # GPUs per server
    mem_fraction_static: float = 0.8
    dtype: str = "auto"
    sampling_backend: Optional[str] = None  # --sampling-backend (None: SGLang's choice)
    enable_memory_saver: bool = False  # --enable-memory-saver: required with rollout.placement=colocated
    extra_args: List[str] = field(default_factory=list)
    env: Dict[str, str] = field(default_factory=dict)
    health_timeout_s: float = 900.0


@dataclass(frozen=True)
class RecoveryConfig:
    """Engine recovery for the engines a run launches (``embedded``, ``sglang``; see
    ``orchestration/engine_health.py``): a dead or hung engine is restarted, given the trainer's current
    weights and re-admitted after its probe check; its requests go to the other engines meanwhile.

    poll_s:            how often each engine's server process is checked (a Ray call; nothing reaches the engine).
    stall_s:           an engine with requests in flight that answered none for this long gets a ``/health`` probe
                       (one generated token); failing it, or no answer within ``health_timeout_s``, means hung.
    max_restarts:      restarts of one engine allowed within ``window_s``; one more and the run stops with the
                       engine's log tail.
    """

    enabled: bool = True
    poll_s: float = 2.0
    stall_s: float = 60.0
    health_timeout_s: float = 60.0  # above SGLang's own 20 s health timeout
    max_restarts: int = 3
    window_s: float = 3600.0

    def __post_init__(self) -> None:
        for name in ("poll_s", "stall_s", "health_timeout_s", "window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"rollout.recovery.{name}={getattr(self, name)}: expected seconds > 0")
        if self.max_restarts < 0:
            raise ValueError(f"rollout.recovery.max_restarts={self.max_restarts}: expected >= 0 (0: never restart)")


@dataclass(frozen=True)
class RolloutConfig:
    """Rollout engines, sampling, dynamic sampling, weight sync and placement.

    engine:                 ``embedded`` (our transformers engine behind the SGLang-compatible HTTP server,
                            one per engine worker; CPU or small GPU runs), ``sglang`` (SGLang servers
                            launched by engine workers) or ``remote`` (servers already running at ``urls``).
    prompts_per_step:       prompt groups in each training batch (after dynamic-sampling filtering).
    dynamic_sampling:       drop groups whose rewards are all equal (no GRPO signal) and over-sample
                            up to ``max_oversample_rounds`` more rounds to refill the batch (DAPO).
    oversample_factor:      each refill round asks for ``ceil(missing * factor)`` more prompts.
    logprob_mode:           ``raw`` (SGLang's ``output_token_logprobs``, full-vocabulary) or ``processed``
                            (renormalised over the top-k/top-p set, SGLang's ``output_token_sampling_logprobs``:
                            pair it with DVP in the objective, and a top-k <= 4096), see rollout/client/protocol.py.
    seeded:                 per-sample sampling seeds derived from (seed, step, round, slot, sample): rollouts are
                            reproducible and a resumed run matches an uninterrupted one. Needs
                            ``deterministic_inference``.
    deterministic_inference: engines honour ``sampling_seed`` (SGLang ``--enable-deterministic-inference``, which
                            launched engines get; ``remote`` servers are checked at start-up). None: as ``seeded``.
                            SGLang's seeded sampler refuses ``min_p > 0``.
    weight_transport:       ``tensor`` (safetensors over HTTP; embedded servers only), ``distributed`` (HTTP
                            announce + torch.distributed broadcast; SGLang), ``ipc`` (colocated engines: every
                            trainer rank beside an engine TP rank hands over its own copy by handle -- CUDA IPC,
                            shared-memory files on CPU -- in SGLang's ``/update_weights_from_tensor`` format) or
                            ``auto`` (``ipc`` for colocated SGLang, ``tensor`` for embedded engines, else
                            ``distributed``).
    placement:              ``colocated`` (engines share the trainers' placement-group bundles -- an SGLang server
                            of TP size k the GPUs of k consecutive trainer ranks -- and release their memory
                            while the trainer runs) or ``disaggregated`` (own bundles).
    offload_trainer:        colocated: move the trainer's optimizer state and gradient buffers to host memory
                            while the engines run (``training/offload.py``). None: on when trainers have GPUs.
    mode:                   how rollouts overlap training (README "Rollout modes"): ``sync`` (generate, then train
                            on it), ``one_step`` (the next step's rollout is generated while this step trains: one
                            step stale) or ``async`` (engines generate continuously from a prompt stream; each step
                            trains as soon as a batch is ready and publishes its weights; ``orchestration/async_rollout.py``).
    max_staleness:          ``async``: no token trained at policy version ``v`` was generated by weights older than
                            ``v - max_staleness`` (>= 1), enforced by admitting new generations only while that can
                            hold -- never by discarding finished ones (``orchestration/staleness.py``).
    partial:                ``async``: in-flight generations pause in place while new weights are published and
                            continue on them (SGLang ``/pause_generation`` in_place); every token keeps the version
                            that produced it and its own behaviour log-prob. Without it, a publish waits for the
                            in-flight generations to finish.
    off_policy:             deprecated alias: 0 is ``mode: sync``, 1 is ``mode: one_step``.
    embedded_dtype:         the embedded engine's weights: ``float32``, or ``bfloat16`` like a production
                            engine (a real training-inference mismatch, e.g. MoE routing that differs).
    recovery:               restart dead or hung engines (``RecoveryConfig``).
    """

    engine: Literal["embedded", "sglang", "remote"] = "embedded"
    urls: List[str] = field(default_factory=list)
    num_engines: int = 1
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    n_samples_per_prompt: int = 8
    prompts_per_step: int = 32
    dynamic_sampling: bool = False
    max_oversample_rounds: int = 3
    oversample_factor: float = 1.0
    logprob_mode: Literal["raw", "processed"] = "raw"
    seeded: bool = True
    deterministic_inference: Optional[bool] = None
    balancer: Literal["round_robin", "least_outstanding"] = "least_outstanding"
    max_concurrency: int = 64  # prompts (requests of n samples) in flight from the driver
    # samples (/generate batch items) in flight to each engine server: what a server can batch at once (SGLang
    # batches whatever is in flight; too few leaves the tail of a step's samples queued client-side)
    max_samples_in_flight: int = 256
    request_timeout_s: float = 600.0
    host: str = "127.0.0.1"  # where engine workers bind their servers ("0.0.0.0" on multi-node clusters)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    weight_transport: Literal["auto", "tensor", "distributed", "ipc"] = "auto"
    placement: Literal["colocated", "disaggregated"] = "colocated"
    offload_trainer: Optional[bool] = None
    mode: Literal["sync", "one_step", "async"] = "sync"
    max_staleness: int = 1
    partial: bool = False
    off_policy: Optional[int] = None  # deprecated: rollout.mode
    embedded_dtype: Literal["float32", "bfloat16"] = "float32"
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)

    def __post_init__(self) -> None:
        if self.n_samples_per_prompt < 1 or self.prompts_per_step < 1 or self.num_engines < 1:
            raise ValueError(f"rollout.n_samples_per_prompt={self.n_samples_per_prompt}, prompts_per_step="
                             f"{self.prompts_per_step} and num_engines={self.num_engines} must all be >= 1")
        if self.max_oversample_rounds < 0 or not self.oversample_factor >= 1.0:
            raise ValueError(f"rollout.max_oversample_rounds={self.max_oversample_rounds} must be >= 0 and "
                             f"oversample_factor={self.oversample_factor} >= 1")
        if self.off_policy is not None:
            self._apply_off_policy_alias()
        if self.max_staleness < 1:
            raise ValueError(f"rollout.max_staleness={self.max_staleness} must be >= 1 (a token may be trained at most "
                             "that many steps after the weights that generated it; 0 is rollout.mode=sync)")
        if self.partial and self.mode != "async":
            raise ValueError(f"rollout.partial=true pauses in-flight generations across weight updates, which only "
                             f"rollout.mode='async' has (mode is {self.mode!r}); set mode=async or partial=false")
        if self.deterministic_inference is None:
            object.__setattr__(self, "deterministic_inference", self.seeded)

    def _apply_off_policy_alias(self) -> None:
        if self.off_policy not in (0, 1):
            raise ValueError(f"rollout.off_policy={self.off_policy}: expected 0 (synchronous) or 1 (one step); it is "
                             "deprecated: use rollout.mode=sync|one_step|async")
        mode = ("sync", "one_step")[self.off_policy]
        if self.mode not in ("sync", mode):
            raise ValueError(f"rollout.off_policy={self.off_policy} (deprecated, = rollout.mode={mode!r}) contradicts "
                             f"rollout.mode={self.mode!r}; remove off_policy")
        logger.warning("rollout.off_policy=%d is deprecated: use rollout.mode=%s", self.off_policy, mode)
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "off_policy", None)

    @property
    def overlapped(self) -> bool:
        """Rollouts run while the trainer trains (one_step, async)."""
        return self.mode != "sync"

    @property
    def transport(self) -> str:
        if self.weight_transport != "auto":
            return self.weight_transport
        if self.engine == "sglang" and self.placement == "colocated":
            return "ipc"
        return "tensor" if self.engine == "embedded" else "distributed"


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


@dataclass(frozen=True)
class PrepareConfig:
    """Assets generated before the config is checked (deterministic, no downloads; skipped when present)."""

    kind: Literal["none", "tiny_arithmetic"] = "none"
    dir: str = "runs/assets"
    seed: int = 0
    # tiny_arithmetic: dense, the MoE variant (8 experts, top-2) or the DeepSeek-V3-style one (MLA, shared expert)
    model: Literal["qwen3", "qwen3_moe", "deepseek_v3"] = "qwen3"


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

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be >= 1")
        if self.resume_step is not None:
            if self.resume_step < 0:
                raise ValueError(f"resume_step={self.resume_step} must be a checkpoint step >= 0")
            self.resume = True
        teacher = self.warmup.teacher
        if teacher is not None:
            ref = self.train.reference_model
            if ref is None:  # the teacher is the trainer's reference model (its logits feed the dense KL)
                ref = dataclasses.replace(self.model, hf_path=teacher)
                self.train = dataclasses.replace(self.train, reference_model=ref)
            elif ref.hf_path != teacher:
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
        import os

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


def _strip_root(message: str) -> str:
    # Users write `rollout.n_samples_per_prompt=8`, not `RunConfig.rollout...`.
    return message.replace("RunConfig.", "").replace("RunConfig: ", "")


def resolve_mapping(recipe: Optional[str], overrides: Sequence[str] = ()) -> Dict[str, Any]:
    """Recipe YAML merged with dotted overrides (no building yet)."""
    base = config_io.load_yaml(recipe) if recipe else {}
    return config_io.merge(base, config_io.parse_overrides(list(overrides)))


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def build_run_config(mapping: Mapping[str, Any]) -> RunConfig:
    mapping = dict(mapping)
    optim = mapping.get("optim")
    if isinstance(optim, Mapping) and _number(optim.get("lr")) is not None \
            and not (math.isfinite(_number(optim["lr"])) and _number(optim["lr"]) > 0):
        raise config_io.ConfigError(f"optim.lr={_number(optim['lr']):g} must be a finite number > 0 (e.g. 1e-6)")
    if isinstance(optim, Mapping) and "lr" in optim and isinstance(optim.get("schedule"), Mapping) \
            and "lr" not in optim["schedule"]:
        # optim.lr is the peak LR; the schedule validates min_lr against its own lr when it is built, before
        # OptimConfig copies optim.lr into it. Give it optim.lr up front, so `optim.lr=...` alone suffices.
        mapping["optim"] = config_io.merge(optim, {"schedule": {"lr": optim["lr"]}})
    try:
        return config_io.build(RunConfig, mapping)
    except config_io.ConfigError as e:
        raise config_io.ConfigError([_strip_root(p) for p in e.problems]) from None


def load_run_config(recipe: Optional[str], overrides: Sequence[str] = (), *, prepare: bool = True,
                    check: bool = True) -> RunConfig:
    """Recipe + overrides -> a checked :class:`RunConfig` (raises :class:`config_io.ConfigError`).

    ``prepare`` first builds generated assets the recipe names (``prepare.kind``), because the data and
    model sections check that their paths exist.
    """
    mapping = resolve_mapping(recipe, overrides)
    if prepare:
        try:
            prep = config_io.build(PrepareConfig, mapping.get("prepare") or {}, "prepare")
        except config_io.ConfigError as e:
            raise config_io.ConfigError(str(e)) from None
        if prep.kind == "tiny_arithmetic":
            from megatron_rl.data.tiny_task import prepare_tiny_arithmetic

            try:
                prepare_tiny_arithmetic(prep.dir, seed=prep.seed, model=prep.model)
            except ValueError as e:  # e.g. the directory holds the other model kind's assets
                raise config_io.ConfigError(str(e)) from None
    # checked: a missing data file is listed with every other problem (check_run_config), not alone
    with deferred_path_checks() if check else contextlib.nullcontext():
        cfg = build_run_config(mapping)
    if check:
        from megatron_rl.config_checks import check_run_config

        check_run_config(cfg)
    return cfg


def dump_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (what the run writes to ``<output_dir>/config.yaml``)."""
    import yaml

    return yaml.safe_dump(config_io.to_dict(cfg), sort_keys=False)
