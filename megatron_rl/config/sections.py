"""Sections of the config tree that components own (the model, its parallel layout, advantages, diagnostics,
routing diagnostics, profiling), as plain data: the components import them from here, so the config loads without torch."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional

MODEL_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ModelConfig:
    """How to build the policy model. Only ``hf_path`` is required."""

    hf_path: str  # local HF directory (config.json + safetensors) or anything AutoConfig accepts
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # parameter dtype
    # Megatron pads the vocabulary to a multiple of vocab_divisor * TP (its default divisor is 128).
    vocab_divisor: int = 128
    # "auto": Transformer Engine spec when TE is importable and CUDA is present, else "local"
    # (portable torch spec: Megatron linears + SDPA attention + RMSNorm).
    layer_spec: Literal["auto", "te", "local"] = "auto"
    # Local spec: RMSNorm, SwiGLU, RoPE and residual adds each one torch.compile'd kernel
    # (models/fused_layer.py), and weight gradients accumulated into DDP's fp32 main_grad inside the wgrad
    # GEMM (models/fused_wgrad.py). "auto": on with CUDA (launch-bound there), off on CPU (no launches to
    # save, and inductor's C++ compile is slow); "on" / "off" force it. Same values and gradients either way.
    fused_elementwise: Literal["auto", "on", "off"] = "auto"
    moe_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    # Build MoE routers with Megatron's RouterReplay (needed by models.router record/replay).
    routing_replay: bool = True
    # None: on whenever TP > 1 (Megatron requires it for MoE with TP > 1).
    sequence_parallel: Optional[bool] = None
    moe_aux_loss_coeff: float = 0.0
    moe_grouped_gemm: bool = False
    seed: int = 1234  # torch is seeded with this on every rank before building (identical init)
    # Escape hatch: extra TransformerConfig fields (e.g. {"recompute_granularity": "full"}).
    transformer_overrides: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"model.dtype={self.dtype!r}: expected one of {sorted(MODEL_DTYPES)}")
        if self.layer_spec not in ("auto", "te", "local"):
            raise ValueError(f"model.layer_spec={self.layer_spec!r}: expected 'auto', 'te' or 'local'")
        if self.fused_elementwise not in ("auto", "on", "off"):
            raise ValueError(f"model.fused_elementwise={self.fused_elementwise!r}: expected 'auto', 'on' or 'off' "
                             "(auto: on with CUDA, off on CPU)")
        if self.moe_dispatcher not in ("alltoall", "allgather"):
            raise ValueError(
                f"model.moe_dispatcher={self.moe_dispatcher!r}: expected 'alltoall' or 'allgather'"
            )
        if self.vocab_divisor < 1:
            raise ValueError(f"model.vocab_divisor={self.vocab_divisor} must be >= 1")


@dataclass(frozen=True)
class ParallelLayout:
    """Model-parallel sizes. Data parallelism is whatever remains of the world size.

    ``etp`` is the tensor-parallel size of MoE experts (None: same as ``tp``, Megatron's default).
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    etp: Optional[int] = None

    def dp(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp * self.cp)

    def check(self, world_size: int) -> None:
        model = self.tp * self.pp * self.cp
        if world_size % model:
            raise ValueError(
                f"world size {world_size} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*{self.cp}"
                f" = {model}; change the parallel sizes or the number of processes"
            )
        dp_cp = self.dp(world_size) * self.cp
        etp = self.tp if self.etp is None else self.etp
        expert_grid = dp_cp * self.tp  # ranks of one pipeline stage, regrouped as etp x ep x edp
        if expert_grid % (etp * self.ep):
            raise ValueError(
                f"expert parallel sizes etp*ep = {etp}*{self.ep} must divide dp*cp*tp = {expert_grid}"
            )


ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "otb", "rtg")


@dataclass(frozen=True)
class AdvantageConfig:
    """Advantage estimator.

    Attributes:
        estimator: ``grpo``, ``rloo``, ``reinforce_pp``, ``reinforce_pp_baseline``, ``otb`` or ``rtg``.
        norm_by_std: GRPO divides by the group std (``False`` = Dr.GRPO; pair it with aggregation mode
            ``seq_mean_token_sum`` or ``fixed``).
        eps: GRPO std epsilon.
        gamma: discount of ``reinforce_pp`` and ``rtg`` (per valid token).
        otb_handle_zero_tail: see :func:`otb.position_baseline`.
        otb_align: ``position`` or ``valid_token`` (multi-turn).
        rtg_baseline: ``group_mean`` or ``none``.
    """

    estimator: str = "grpo"
    norm_by_std: bool = True
    eps: float = 1e-6
    gamma: float = 1.0
    otb_handle_zero_tail: bool = True
    otb_align: str = "position"
    rtg_baseline: str = "group_mean"

    def __post_init__(self) -> None:
        if self.estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"AdvantageConfig.estimator={self.estimator!r} is not one of {ADVANTAGE_ESTIMATORS}")
        if not self.eps > 0:
            raise ValueError(f"AdvantageConfig.eps={self.eps} must be > 0")
        if not 0 < self.gamma <= 1:
            raise ValueError(f"AdvantageConfig.gamma={self.gamma} must be in (0, 1]")
        if self.otb_align not in ("position", "valid_token"):
            raise ValueError(f"AdvantageConfig.otb_align={self.otb_align!r} must be 'position' or 'valid_token'")
        if self.rtg_baseline not in ("group_mean", "none"):
            raise ValueError(f"AdvantageConfig.rtg_baseline={self.rtg_baseline!r} must be 'group_mean' or 'none'")


@dataclass(frozen=True)
class DiagnosticsConfig:
    """Extra per-step diagnostics.

    Attributes:
        gain: the §h gain decomposition (``gain/*`` metrics) from one more forward pass of the step's
            batch after the update (the cost of one old-log-prob pass).
        reward_max: R_max of ``gain/slack`` (rewards in [0, R_max]): the certified bound. ``None``: the
            batch's largest |R − b| (an estimate of it, tighter; exact_match / math rewards: 1).
    """

    gain: bool = False
    reward_max: Optional[float] = None

    def __post_init__(self) -> None:
        if self.reward_max is not None and not self.reward_max > 0:
            raise ValueError(f"diagnostics.reward_max={self.reward_max} must be > 0 (or None: from the batch)")


@dataclass(frozen=True)
class RoutingDiagnosticsConfig:
    """MoE routing metrics (batches that carry ``routed_experts``).

    Attributes:
        agreement: per-layer routing agreement with the rollout engine in every ``train_step`` and
            ``forward`` (``routing/agreement_layer{i}``, ``routing/agreement_mean``). Costs no forward: with
            replay each router's own top-k is computed next to the replayed one.
        without_replay: with ``routing_replay`` on, one extra forward-only pass per train step *without*
            replay, before the update: ``routing/no_replay/agreement_*``, ``routing/no_replay/mismatch_k3``
            and ``routing/no_replay/logprob_abs_diff``, next to the with-replay ``routing/mismatch_k3`` and
            ``routing/logprob_abs_diff``. Off by default (a forward per step); turn it on for diagnostics runs.
    """

    agreement: bool = True
    without_replay: bool = False


@dataclass(frozen=True)
class ProfileConfig:
    """Which steps and processes to trace.

    steps:         1-based steps to capture (empty: none).
    trainer_ranks: global trainer ranks that record a trace.
    engines:       also trace the rollout engines (their servers' ``/start_profile``: SGLang's own, or the
                   embedded server's torch profiler over its process).
    dir:           output directory (None: ``<logging.output_dir>/profile``).
    record_shapes, with_stack: the torch profiler's options (more detail, larger traces).
    """

    steps: List[int] = field(default_factory=list)
    trainer_ranks: List[int] = field(default_factory=lambda: [0])
    engines: bool = True
    dir: Optional[str] = None
    record_shapes: bool = False
    with_stack: bool = False

    def __post_init__(self) -> None:
        bad = [s for s in self.steps if not isinstance(s, int) or s < 1]
        if bad:
            raise ValueError(f"profile.steps={self.steps}: steps are 1-based integers, got {bad}")
        bad = [r for r in self.trainer_ranks if not isinstance(r, int) or r < 0]
        if bad:
            raise ValueError(f"profile.trainer_ranks={self.trainer_ranks}: ranks are integers >= 0, got {bad}")

    def step_dir(self, output_dir: str, step: int) -> str:
        return os.path.join(self.dir or os.path.join(output_dir, "profile"), f"step_{step}")
