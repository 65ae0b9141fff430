"""The ``rollout`` section: engines, sampling, the driver's client, weight publishing, overlap and recovery, each
its own sub-section that validates itself, under the batch settings of :class:`RolloutConfig`.

The section was flat once; every flat key still works, in recipes and on the command line
(``rollout.mode=async`` is ``rollout.overlap.mode=async``), through the one table :data:`ALIASES`, which also
serves reads of the flat names (``cfg.rollout.mode``). ``rollout.off_policy`` (0: sync, 1: one_step) is the
deprecated spelling of ``rollout.overlap.mode``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Mapping, Optional, Tuple

from megatron_rl.config_io import ConfigError

logger = logging.getLogger(__name__)
ROLLOUT_MODES = ("sync", "one_step", "async")
ENGINE_DTYPES = ("float32", "float64", "float16", "bfloat16", "half", "float", "double")
PROCESSED_MAX_SUPPORT = 4096  # SGLang 0.5.23's default --sampling-mask-max-tokens

@dataclass(frozen=True)
class SamplingConfig:
    """Rollout sampling (SGLang names). The tokenizer's EOS is a stop token unless ``ignore_eos`` (benchmarks:
    responses run to ``max_new_tokens``, or to a prompt's own ``max_new_tokens`` data column when
    ``data.metadata_fields`` lists it)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 1024
    stop_token_ids: List[int] = field(default_factory=list)
    ignore_eos: bool = False

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


@dataclass
class WeightSyncConfig:
    """``bucket_mb``: bucket size limit (MiB, in the engine dtype). ``check_tolerance``: max |log-prob
    difference| allowed between engine and trainer on the probe (fp32 both sides: 1e-4; a bf16 engine
    against an fp32 trainer: ~0.25, see the module doc). ``probe_length`` is capped at the model's
    context - 1 and rounded down to a multiple of TP (sequence parallelism)."""

    bucket_mb: float = 512.0
    check: bool = True
    check_tolerance: Optional[float] = None  # max |diff|; None: 1e-4 for a float32 engine, 1.0 for bf16 / fp16
    check_mean_tolerance: Optional[float] = None  # mean |diff|; None: none for float32, 0.1 for bf16 / fp16
    probe_length: int = 256
    probe_seed: int = 0
    engine_dtype: Optional[str] = None  # None: an EmbeddedEngine's own dtype, else the trainer's params dtype
    progress: bool = True  # tqdm bar on the sender (bytes sent)
    replay_routing: bool = False  # MoE: the trainer's probe forward replays each engine's routing of the probe
    per_rank: bool = True  # every rank sends the pieces it owns to the sender (weight_links.py); False: all-gather
    # the whole sync's deadline (stage + verify + commit; every HTTP call of it bounded by what is left); None:
    # max(120 s, 10 x model bytes / the link's last measured rate, 1 GB/s before one is measured) (weights/deadline.py)
    timeout_s: Optional[float] = None

    def __post_init__(self) -> None:
        if not (isinstance(self.bucket_mb, (int, float)) and math.isfinite(self.bucket_mb) and self.bucket_mb > 0):
            raise ValueError(f"weight_sync.bucket_mb={self.bucket_mb!r}: expected a size in MiB > 0 (e.g. 512)")
        for name in ("check_tolerance", "check_mean_tolerance"):
            tol = getattr(self, name)
            if tol is not None and not (isinstance(tol, (int, float)) and math.isfinite(tol) and tol > 0):
                raise ValueError(f"weight_sync.{name}={tol!r}: expected a finite number > 0 (or unset: chosen by "
                                 "the engine's dtype)")
        if self.timeout_s is not None and not (isinstance(self.timeout_s, (int, float)) and
                                               math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"weight_sync.timeout_s={self.timeout_s!r}: expected seconds > 0 (or unset: derived from "
                             "the model's bytes and the link's rate, at least 120 s)")
        if not isinstance(self.probe_length, int) or self.probe_length < 2:
            raise ValueError(f"weight_sync.probe_length={self.probe_length!r}: expected an integer >= 2 tokens")
        if self.engine_dtype is not None:
            if str(self.engine_dtype).replace("torch.", "") not in ENGINE_DTYPES:
                raise ValueError(f"weight_sync.engine_dtype: unknown dtype {self.engine_dtype!r} (expected e.g. "
                                 "'bfloat16', 'float32')")

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * (1 << 20)))

    def tolerances(self, engine_dtype: Any) -> Tuple[float, Optional[float]]:
        """(max, mean) |log-prob difference| allowed for an engine holding ``engine_dtype`` weights (a torch
        dtype or its name)."""
        exact = str(engine_dtype).replace("torch.", "") in ("float32", "float64")
        high = self.check_tolerance if self.check_tolerance is not None else (1e-4 if exact else 1.0)
        mean = self.check_mean_tolerance if self.check_mean_tolerance is not None else (None if exact else 0.1)
        return float(high), mean


@dataclass(frozen=True)
class EnginesConfig:
    """Where rollouts are generated.

    kind:                   ``embedded`` (our transformers engine behind the SGLang-compatible HTTP server,
                            one per engine worker; CPU or small GPU runs), ``sglang`` (SGLang servers
                            launched by engine workers) or ``remote`` (servers already running at ``urls``).
    deterministic_inference: engines honour ``sampling_seed`` (SGLang ``--enable-deterministic-inference``, which
                            launched engines get; ``remote`` servers are checked at start-up). None: as
                            ``rollout.seeded``. SGLang's seeded sampler refuses ``min_p > 0``.
    placement:              ``colocated`` (engines share the trainers' placement-group bundles -- an SGLang server
                            of TP size k the GPUs of k consecutive trainer ranks -- and release their memory
                            while the trainer runs) or ``disaggregated`` (own bundles).
    offload_trainer:        colocated: move the trainer's optimizer state and gradient buffers to host memory
                            while the engines run (``training/offload.py``). None: on when trainers have GPUs.
    embedded_dtype:         the embedded engine's weights: ``float32``, or ``bfloat16`` like a production
                            engine (a real training-inference mismatch, e.g. MoE routing that differs).
    """

    kind: Literal["embedded", "sglang", "remote"] = "embedded"
    urls: List[str] = field(default_factory=list)
    count: int = 1
    host: str = "127.0.0.1"  # where engine workers bind their servers ("0.0.0.0" on multi-node clusters)
    placement: Literal["colocated", "disaggregated"] = "colocated"
    offload_trainer: Optional[bool] = None
    deterministic_inference: Optional[bool] = None
    embedded_dtype: Literal["float32", "bfloat16"] = "float32"
    sglang: SGLangConfig = field(default_factory=SGLangConfig)

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"rollout.num_engines={self.count} must be >= 1")


@dataclass(frozen=True)
class ClientConfig:
    """The driver's requests to the engines.

    logprob_mode: ``raw`` (SGLang's ``output_token_logprobs``, full-vocabulary) or ``processed`` (renormalised
                  over the top-k/top-p set, SGLang's ``output_token_sampling_logprobs``: pair it with DVP in the
                  objective, and a top-k <= 4096), see rollout/client/protocol.py.
    """

    balancer: Literal["round_robin", "least_outstanding"] = "least_outstanding"
    max_concurrency: int = 64  # prompts (requests of n samples) in flight from the driver
    # samples (/generate batch items) in flight to each engine server: what a server can batch at once (SGLang
    # batches whatever is in flight; too few leaves the tail of a step's samples queued client-side)
    max_samples_in_flight: int = 256
    request_timeout_s: float = 600.0
    # every control call (pause / continue / flush / release and resume memory / weight version): an engine that
    # does not answer one within this is reported to engine recovery, not waited for request_timeout_s
    control_timeout_s: float = 30.0
    logprob_mode: Literal["raw", "processed"] = "raw"

    def __post_init__(self) -> None:
        t = self.control_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
            raise ValueError(f"rollout.control_timeout_s={t!r}: expected a finite number of seconds > 0 (e.g. 30); "
                             "it bounds each pause / flush / memory / weight-version call to an engine")


@dataclass(frozen=True)
class WeightsConfig:
    """Weight publishing to the engines.

    transport: ``tensor`` (safetensors over HTTP; embedded servers only), ``distributed`` (HTTP announce +
               torch.distributed broadcast; SGLang), ``ipc`` (colocated engines: every trainer rank beside an
               engine TP rank hands over its own copy by handle -- CUDA IPC, shared-memory files on CPU -- in
               SGLang's ``/update_weights_from_tensor`` format) or ``auto`` (``ipc`` for colocated SGLang, ``tensor``
               for embedded engines, else ``distributed``).
    """

    transport: Literal["auto", "tensor", "distributed", "ipc"] = "auto"
    sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)


@dataclass(frozen=True)
class OverlapConfig:
    """How rollouts overlap training (README "Rollout modes").

    mode:          ``sync`` (generate, then train on it), ``one_step`` (the next step's rollout is generated while
                   this step trains: one step stale) or ``async`` (engines generate continuously from a prompt
                   stream; each step trains as soon as a batch is ready and publishes its weights;
                   ``orchestration/async_rollout.py``).
    max_staleness: ``async``: no token trained at policy version ``v`` was generated by weights older than
                   ``v - max_staleness`` (>= 1), enforced by admitting new generations only while that can hold --
                   never by discarding finished ones (``orchestration/staleness.py``).
    partial:       ``async``: in-flight generations pause while new weights are published and continue on them
                   (SGLang ``/pause_generation`` retract: their KV is rebuilt under the new weights, so the
                   per-sync cache flush succeeds); every token keeps the version that produced it
                   and its own behaviour log-prob. Without it, a publish waits for the in-flight generations.
    """

    mode: Literal["sync", "one_step", "async"] = "sync"
    max_staleness: int = 1
    partial: bool = False

    def __post_init__(self) -> None:
        if self.max_staleness < 1:
            raise ValueError(f"rollout.max_staleness={self.max_staleness} must be >= 1 (a token may be trained at most "
                             "that many steps after the weights that generated it; 0 is rollout.mode=sync)")
        if self.partial and self.mode != "async":
            raise ValueError(f"rollout.partial=true pauses in-flight generations across weight updates, which only "
                             f"rollout.mode='async' has (mode is {self.mode!r}); set mode=async or partial=false")


# The flat keys of the section before it had sub-sections -> their place now. Recipes, command-line overrides and
# attribute reads (cfg.rollout.mode) accept both.
ALIASES: Dict[str, str] = {
    "engine": "engines.kind", "urls": "engines.urls", "num_engines": "engines.count", "host": "engines.host",
    "placement": "engines.placement", "offload_trainer": "engines.offload_trainer",
    "deterministic_inference": "engines.deterministic_inference", "embedded_dtype": "engines.embedded_dtype",
    "sglang": "engines.sglang",
    "balancer": "client.balancer", "max_concurrency": "client.max_concurrency",
    "max_samples_in_flight": "client.max_samples_in_flight", "request_timeout_s": "client.request_timeout_s",
    "control_timeout_s": "client.control_timeout_s",
    "logprob_mode": "client.logprob_mode",
    "weight_transport": "weights.transport", "weight_sync": "weights.sync",
    "mode": "overlap.mode", "max_staleness": "overlap.max_staleness", "partial": "overlap.partial",
}
OFF_POLICY_MODES = ("sync", "one_step")  # rollout.off_policy (deprecated) 0 / 1


def normalize_keys(mapping: Mapping[str, Any]) -> Dict[str, Any]:
    """A ``rollout`` mapping with the flat keys moved to their sub-sections (and ``off_policy`` to
    ``overlap.mode``); a key given both ways with different values is an error."""
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in mapping.items() if k not in ALIASES}
    for old, new in ALIASES.items():
        if old not in mapping:
            continue
        section, key = new.split(".")
        sub = out.setdefault(section, {})
        if not isinstance(sub, dict):
            raise ConfigError(f"rollout.{section}: expected a mapping, got {sub!r}")
        if key in sub and sub[key] != mapping[old]:
            raise ConfigError(f"rollout.{old}={mapping[old]!r} and rollout.{new}={sub[key]!r} set the same field; "
                              f"keep one (rollout.{new})")
        sub[key] = mapping[old]
    if "off_policy" in out:
        _apply_off_policy(out)
    return out


def _apply_off_policy(out: Dict[str, Any]) -> None:
    off_policy = out.pop("off_policy")
    if off_policy is None:
        return
    if off_policy not in (0, 1) or isinstance(off_policy, bool):
        raise ConfigError(f"rollout.off_policy={off_policy}: expected 0 (synchronous) or 1 (one step); it is "
                          "deprecated: use rollout.mode=sync|one_step|async")
    mode = OFF_POLICY_MODES[off_policy]
    overlap = out.setdefault("overlap", {})
    given = overlap.get("mode", "sync")
    if given not in ("sync", mode):
        raise ConfigError(f"rollout.off_policy={off_policy} (deprecated, = rollout.mode={mode!r}) contradicts "
                          f"rollout.mode={given!r}; remove off_policy")
    logger.warning("rollout.off_policy=%d is deprecated: use rollout.mode=%s", off_policy, mode)
    overlap["mode"] = mode


@dataclass(frozen=True)
class RolloutConfig:
    """What each step's batch is, and the sub-sections that make it.

    prompts_per_step:       prompt groups in each training batch (after dynamic-sampling filtering).
    dynamic_sampling:       drop groups whose rewards are all equal (no GRPO signal) and over-sample
                            up to ``max_oversample_rounds`` more rounds to refill the batch (DAPO).
    oversample_factor:      each refill round asks for ``ceil(missing * factor)`` more prompts.
    seeded:                 per-sample sampling seeds derived from (seed, step, round, slot, sample): rollouts are
                            reproducible and a resumed run matches an uninterrupted one. Needs
                            ``engines.deterministic_inference``.
    """

    n_samples_per_prompt: int = 8
    prompts_per_step: int = 32
    dynamic_sampling: bool = False
    max_oversample_rounds: int = 3
    oversample_factor: float = 1.0
    seeded: bool = True
    engines: EnginesConfig = field(default_factory=EnginesConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)

    normalize_keys = staticmethod(normalize_keys)  # config_io applies it to the mapping before building

    def __post_init__(self) -> None:
        if self.n_samples_per_prompt < 1 or self.prompts_per_step < 1:
            raise ValueError(f"rollout.n_samples_per_prompt={self.n_samples_per_prompt} and prompts_per_step="
                             f"{self.prompts_per_step} must both be >= 1")
        if self.max_oversample_rounds < 0 or not self.oversample_factor >= 1.0:
            raise ValueError(f"rollout.max_oversample_rounds={self.max_oversample_rounds} must be >= 0 and "
                             f"oversample_factor={self.oversample_factor} >= 1")

    def __getattr__(self, name: str) -> Any:
        """The flat names (:data:`ALIASES`) read from their sub-sections; ``off_policy`` is always resolved."""
        if name == "off_policy":
            return None
        path = ALIASES.get(name)
        if path is None:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}")
        section, key = path.split(".")
        return getattr(getattr(self, section), key)

    @property
    def deterministic_inference(self) -> bool:
        d = self.engines.deterministic_inference
        return self.seeded if d is None else d

    @property
    def overlapped(self) -> bool:
        """Rollouts run while the trainer trains (one_step, async)."""
        return self.overlap.mode != "sync"

    @property
    def transport(self) -> str:
        """The weight transport ``weights.transport=auto`` resolves to."""
        e = self.engines
        if self.weights.transport != "auto":
            return self.weights.transport
        if e.kind == "sglang" and e.placement == "colocated":
            return "ipc"
        return "tensor" if e.kind == "embedded" else "distributed"

    def problems(self) -> List[str]:
        """What is wrong with the section as a whole (the sub-sections' combinations), every problem at once; the
        run's checks (``config/checks.py``) report them with the cross-section ones."""
        r, out = self, []
        if r.engine == "remote" and not r.urls:
            out.append("rollout.engine='remote' needs rollout.urls (e.g. [http://host:30000]) of running servers")
        if r.engine != "remote" and r.urls:
            out.append(f"rollout.urls={r.urls} is only used with rollout.engine='remote' (engine is {r.engine!r}); "
                       "remove urls or set engine: remote")
        for name in ("max_concurrency", "max_samples_in_flight"):
            if getattr(r, name) < 1:
                out.append(f"rollout.{name}={getattr(r, name)} must be >= 1 (requests in flight; e.g. 64 / 256)")
        if r.overlapped and r.placement == "colocated":
            out.append(f"rollout.mode={r.mode!r} generates while the trainer trains, but rollout.placement='colocated' "
                       "engines share the trainer's devices and release their memory while it runs, so nothing can "
                       "overlap; set rollout.placement=disaggregated (or rollout.mode=sync)")
        out += self._transport_problems()
        if r.seeded and not r.deterministic_inference:
            out.append("rollout.seeded=true needs engines that honour sampling_seed, which SGLang does only with "
                       "--enable-deterministic-inference, but rollout.deterministic_inference=false; set it to true "
                       "(or leave it unset) or set rollout.seeded=false")
        if r.deterministic_inference and r.sampling.min_p > 0:
            out.append(f"rollout.sampling.min_p={r.sampling.min_p} with deterministic inference (rollout.seeded / "
                       "rollout.deterministic_inference): SGLang's seeded sampler asserts on min_p > 0 "
                       "(srt/layers/sampler.py); set min_p=0 (top_k / top_p still filter) or rollout.seeded=false and "
                       "rollout.deterministic_inference=false")
        s = r.sampling
        if r.logprob_mode == "processed" and s.filtered and not 1 <= s.top_k <= PROCESSED_MAX_SUPPORT:
            out.append(f"rollout.logprob_mode='processed' reads SGLang's output_token_sampling_logprobs, and SGLang "
                       f"aborts every request whose sampling support exceeds --sampling-mask-max-tokens "
                       f"({PROCESSED_MAX_SUPPORT}); rollout.sampling.top_k={s.top_k} does not bound it: set top_k to at "
                       f"most {PROCESSED_MAX_SUPPORT} (e.g. 1024)")
        ws = r.weight_sync
        if r.engine == "embedded" and r.embedded_dtype == "bfloat16" and ws.check and ws.check_tolerance is not None \
                and ws.check_tolerance < 0.1:
            out.append(f"rollout.embedded_dtype='bfloat16' engines differ from the fp32 trainer by ~0.02-0.08 in probe "
                       f"log-probs, above rollout.weight_sync.check_tolerance={ws.check_tolerance:g}; set it to 0.25 or "
                       "leave it unset (bf16 engines are then checked on the mean |diff|, 0.1, and max 1.0)")
        if not s.temperature > 0:
            out.append(f"rollout.sampling.temperature={s.temperature}: RL rollouts must sample (> 0); greedy is for "
                       "eval.greedy")
        return out

    def _transport_problems(self) -> List[str]:
        r, out = self, []
        if r.transport == "ipc" and r.placement != "colocated":
            out.append("rollout.weight_transport='ipc' hands each engine TP rank a handle to the memory of the trainer "
                       "rank on its GPU: it needs rollout.placement=colocated (disaggregated engines: 'distributed')")
        if r.transport == "ipc" and r.engine == "remote":
            out.append("rollout.weight_transport='ipc' needs engines this run places beside its trainer ranks (engine "
                       "'sglang' or 'embedded'); remote servers take 'distributed'")
        if r.offload_trainer and r.placement != "colocated":
            out.append("rollout.offload_trainer=true frees the trainer's GPU memory for colocated engines, but "
                       "rollout.placement='disaggregated' engines have their own GPUs; set offload_trainer=false")
        if r.engine == "sglang" and r.weight_transport == "tensor":
            out.append("rollout.weight_transport='tensor' sends safetensors buckets, which only the embedded server "
                       "accepts; use 'distributed' (or 'auto') with SGLang")
        if r.engine in ("sglang", "remote") and r.weight_transport == "tensor":
            out.append(f"rollout.weight_transport='tensor' sends the embedded server's safetensors buckets, which "
                       f"SGLang refuses (engine={r.engine!r}); use 'distributed' (or 'auto')")
        return out
