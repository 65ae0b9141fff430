"""The trainer's part of the config tree: :class:`OptimConfig` and :class:`TrainConfig`.

Both are validated on construction (``ValueError`` naming the field and what to change). Checks that
need the batch or the model (sequence lengths, divisibility by the micro-batch size) live with the
batch (:mod:`megatron_rl.training.batch`) and run once per step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal, Optional, Tuple

from megatron_rl.config.objective import ObjectiveConfig
from megatron_rl.config.sections import ModelConfig, RoutingDiagnosticsConfig
from megatron_rl.lr_schedules import LRScheduleConfig

_DEFAULT_SCHEDULE_LR = LRScheduleConfig().lr


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer (Megatron's Adam: AdamW-style decoupled weight decay) and LR schedule.

    Attributes:
        lr: peak learning rate. The schedule's own ``lr`` is taken from here (leave it at its default, or
            equal, e.g. when a cosine ``min_lr`` above the default needs it at construction).
        weight_decay: decoupled weight decay (Megatron skips biases and 1-D parameters, e.g. norms).
        adam_beta1, adam_beta2, adam_eps: Adam hyper-parameters.
        clip_grad: global gradient-norm clip (0 disables clipping; the norm is still computed, to detect
            non-finite gradients).
        use_distributed_optimizer: shard optimizer state over data-parallel ranks (Megatron's
            DistributedOptimizer; works on CPU through :mod:`megatron_rl.compat`).
        schedule: LR schedule (warmup + constant / cosine / length-surge), stepped once per successful
            optimizer step.
        nonfinite_weights: what happens when an optimizer step (with finite gradients) makes the weights
            non-finite: ``rollback`` (the step is undone and counted as skipped) or ``stop`` (the run stops with
            an error). Free in a sane run: a bound on Adam's update (:mod:`megatron_rl.training.nan_guard`)
            proves the step safe before it is taken; only a step it cannot prove safe keeps a host copy of the
            parameters and Adam state (~4x the parameter bytes) to roll back from.
    """

    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = True
    schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    nonfinite_weights: Literal["rollback", "stop"] = "rollback"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"optim.lr={self.lr} must be a finite number > 0 (e.g. 1e-6)")
        if self.nonfinite_weights not in ("rollback", "stop"):
            raise ValueError(f"optim.nonfinite_weights={self.nonfinite_weights!r}: expected 'rollback' or 'stop'")
        if not self.weight_decay >= 0:
            raise ValueError(f"optim.weight_decay={self.weight_decay} must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            v = getattr(self, name)
            if not 0 <= v < 1:
                raise ValueError(f"optim.{name}={v} must be in [0, 1)")
        if not self.adam_eps > 0:
            raise ValueError(f"optim.adam_eps={self.adam_eps} must be > 0")
        if not self.clip_grad >= 0:
            raise ValueError(f"optim.clip_grad={self.clip_grad} must be >= 0 (0 disables clipping)")
        if not isinstance(self.schedule, LRScheduleConfig):
            raise ValueError(f"optim.schedule must be an LRScheduleConfig, got {type(self.schedule).__name__}")
        if self.schedule.lr not in (self.lr, _DEFAULT_SCHEDULE_LR):
            raise ValueError(
                f"optim.schedule.lr={self.schedule.lr} differs from optim.lr={self.lr}: the peak learning rate is "
                "optim.lr; leave schedule.lr at its default or give it the same value"
            )
        # The schedule's peak LR is optim.lr (re-validates min_lr <= lr).
        object.__setattr__(self, "schedule", dataclasses.replace(self.schedule, lr=self.lr))


@dataclass(frozen=True)
class TrainConfig:
    """How a train step turns a batch into a loss.

    Attributes:
        micro_batch_size: sequences per micro-batch when no token budget is set. The data-parallel rank's
            batch must be a multiple of it; the number of micro-batches is ``batch_size / micro_batch_size``.
        packing: concatenate a micro-batch's sequences into one ``[1, T]`` stream (THD, ``cu_seqlens``)
            instead of padding every row to the longest: positions restart per sequence, attention never
            crosses one, no compute is spent on padding (:mod:`megatron_rl.training.micro_batch`).
        max_tokens_per_micro_batch: token budget of a train micro-batch per context-parallel rank (0: a
            fixed ``micro_batch_size``). Sequences are packed under this hard cap into as few micro-batches
            as it allows, estimated work balanced over them and (through the driver) over data-parallel
            ranks, the same count on every rank (:mod:`megatron_rl.training.token_budget`). Needs ``packing``.
        forward_max_tokens_per_micro_batch: the same for the forward-only passes (old / reference
            log-probs), which keep no activations for a backward and can take more (0: as
            ``max_tokens_per_micro_batch``).
        temperature: sampling temperature of the rollout; logits are divided by it before every
            statistic (log-probs, entropy, KL, DVP).
        objective: the RL loss (:class:`megatron_rl.objectives.ObjectiveConfig`).
        pad_to_multiple: each micro-batch is right-padded to its own longest sequence (packed: the stream to
            its total), rounded up to this multiple (and to what sequence and context parallelism need).
        group_by_length: sort sequences by length before cutting fixed-size micro-batches (less padding).
            The loss and gradient do not depend on the grouping: the step's normaliser is global.
        routing_replay: replay the rollout engine's MoE expert choices (``TrainBatch.routed_experts``) in the
            train step, ``forward`` (old log-probs) and the reference model's pass (:mod:`megatron_rl.routing`).
        routing_diagnostics: MoE routing metrics: per-layer agreement with the engine (every step, free) and
            the optional pass without replay (:class:`megatron_rl.routing.RoutingDiagnosticsConfig`).
        reference_model: a frozen reference policy (same layout) for the exact per-token KL: the dense
            imitation term (``objective.dense_kl``), ``kl_penalty`` with ``estimator='exact'``, and
            ``ref_kl`` in forward results. Its logits are kept for all of a step's micro-batches.
        chunk_size: rows per chunk of the vocabulary-parallel ops (None: their default).
        fused_head: compute the token statistics from the output layer's input and weight
            (:func:`megatron_rl.ops.vocab_parallel_linear_stats`) instead of from materialised logits: the
            ``[T, V/TP]`` logits and their gradient are never held (one ``[chunk, V/TP]`` block at a time),
            and only response positions are computed; backward recomputes the logits block by block.
    """

    micro_batch_size: int = 1
    packing: bool = True
    max_tokens_per_micro_batch: int = 0
    forward_max_tokens_per_micro_batch: int = 0
    temperature: float = 1.0
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    pad_to_multiple: int = 1
    group_by_length: bool = True
    routing_replay: bool = False
    routing_diagnostics: RoutingDiagnosticsConfig = field(default_factory=RoutingDiagnosticsConfig)
    reference_model: Optional[ModelConfig] = None
    chunk_size: Optional[int] = None
    fused_head: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.micro_batch_size, int) or self.micro_batch_size < 1:
            raise ValueError(f"train.micro_batch_size={self.micro_batch_size!r} must be a positive integer")
        for name in ("max_tokens_per_micro_batch", "forward_max_tokens_per_micro_batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"train.{name}={v!r} must be an integer >= 0 (0: fixed train.micro_batch_size)")
            if v and not self.packing:
                raise ValueError(f"train.{name}={v} packs sequences under a token budget, which needs "
                                 "train.packing=true; set it, or use train.micro_batch_size with padding")
        if self.forward_max_tokens_per_micro_batch and not self.max_tokens_per_micro_batch:
            raise ValueError(f"train.forward_max_tokens_per_micro_batch={self.forward_max_tokens_per_micro_batch} "
                             "needs train.max_tokens_per_micro_batch > 0 too (the train step's budget)")
        if not self.temperature > 0:
            raise ValueError(f"train.temperature={self.temperature} must be > 0")
        if not isinstance(self.objective, ObjectiveConfig):
            raise ValueError(f"train.objective must be an ObjectiveConfig, got {type(self.objective).__name__}")
        if not isinstance(self.pad_to_multiple, int) or self.pad_to_multiple < 1:
            raise ValueError(f"train.pad_to_multiple={self.pad_to_multiple!r} must be a positive integer")
        if not isinstance(self.fused_head, bool):
            raise ValueError(f"train.fused_head={self.fused_head!r} must be true or false")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"train.chunk_size={self.chunk_size} must be >= 1 or None")
        if self.needs_reference_logits and self.reference_model is None:
            raise ValueError(
                "the objective needs the exact per-token KL to a reference policy (objective.dense_kl.beta > 0 or "
                "objective.kl_penalty with estimator='exact' in the loss): set train.reference_model"
            )
        trm = self.objective.trm
        if trm.enabled and trm.divergence == "exact":
            raise ValueError(
                "objective.trm.divergence='exact' needs the rollout engine's full distribution (LossInputs."
                "rollout_kl), which a TrainBatch does not carry; use divergence='sample' or 'auto'"
            )

    @property
    def token_budget(self) -> bool:
        return self.max_tokens_per_micro_batch > 0

    def token_budget_of(self, forward_only: bool) -> Tuple[int, str]:
        """(token budget per CP rank of a pass, the field that sets it); 0: fixed ``micro_batch_size``."""
        if forward_only and self.forward_max_tokens_per_micro_batch:
            return self.forward_max_tokens_per_micro_batch, "train.forward_max_tokens_per_micro_batch"
        return self.max_tokens_per_micro_batch, "train.max_tokens_per_micro_batch"

    @property
    def needs_reference_logits(self) -> bool:
        return self.objective.needs_reference_logits

    @property
    def dvp_min_p(self) -> Optional[float]:
        """min-p of the fused DVP path (None: DVP off or another rule)."""
        dvp = self.objective.dvp
        return dvp.min_p if dvp.enabled and dvp.rule == "min_p" else None
