"""The policy trainer: a Megatron GPTModel stage, DDP, optimizer and LR schedule behind two calls.

    trainer = PolicyTrainer(ModelConfig(hf_path=...), TrainConfig(...), groups, OptimConfig(...))
    old = trainer.forward(batch)                                   # log π_old, entropy, Σπ² [B, R]
    result = trainer.train_step(batch.replace(old_logprobs=old.logprobs))

Every rank of the job calls both with its data-parallel replica's batch (all TP/PP ranks of a
replica pass the same batch; this is checked). Results are returned on every rank: ``forward`` gives
the replica's own sequences, ``train_step`` the step-global loss and metrics.

Loss scaling. The objectives' contract: micro-batch and data-parallel contributions ``ℓ_{r,k}`` add up to
the step loss ``L = Σ_r Σ_k ℓ_{r,k}`` given the step's Normalizer. Megatron back-propagates
``ℓ' · cp / M`` per micro-batch (M micro-batches) and DDP scales the gradient sum over the
data-parallel(+CP) group by ``1 / (dp · cp)``, so the gradient applied is
``Σ_{r,k} (cp / M) ∇ℓ'_{r,k} / (dp · cp) = (1 / (M · dp)) Σ ∇ℓ'``. Returning ``ℓ' = ℓ · M · dp``
(written ``M · dp_cp / cp``) makes it exactly ∇L, the gradient of the unsplit global loss
(tests/distributed/test_train_invariance.py checks it against plain autograd on the whole batch).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_rl.lr_schedules import LRSchedule, set_lr
from megatron_rl.models.build import BuiltModel, build_model, load_arch
from megatron_rl.models.config import ModelConfig
from megatron_rl.objectives import ObjectiveConfig, ReduceGroups, step_normalizer
from megatron_rl.objectives.reduce import broadcast_scalar, global_mean_response_length
from megatron_rl.parallel import ParallelGroups
from megatron_rl.training import head, loss_glue
from megatron_rl.training.batch import MicroBatch, TrainBatch
from megatron_rl.config.train import OptimConfig, TrainConfig
from megatron_rl.training.optim import build_ddp_and_optimizer, guarded_step, zero_grads
from megatron_rl.training.pipeline import run_micro_batches
from megatron_rl.training.results import ForwardResult, StepResult, merge_micro_batch_metrics
from megatron_rl.training.routing import TrainerRouting
from megatron_rl.training.token_budget import WorkModel
from megatron_rl.training.trainer_batches import TrainerBatches
from megatron_rl.training.trainer_passes import TrainerPasses

logger = logging.getLogger(__name__)


def pipeline_ready(cfg: ModelConfig, pipeline_size: int) -> ModelConfig:
    """Let pipeline stages exchange each micro-batch's shape (``variable_seq_lengths``), so every
    micro-batch is padded only to its own length. Megatron refuses the flag with the MoE ``allgather``
    dispatcher (a config check, which also fires for dense models, whose dispatcher setting is unused):
    dense models get ``alltoall`` to pass it; MoE ``allgather`` models keep fixed-length micro-batches."""
    if pipeline_size == 1:
        return cfg
    is_moe = load_arch(cfg.hf_path).is_moe
    if is_moe and cfg.moe_dispatcher != "alltoall":
        return cfg
    ours = {"variable_seq_lengths": True} if is_moe else {"variable_seq_lengths": True,
                                                           "moe_token_dispatcher_type": "alltoall"}
    return dataclasses.replace(cfg, transformer_overrides={**ours, **cfg.transformer_overrides})


class PolicyTrainer(TrainerBatches, TrainerPasses):
    """Model, DDP wrapper, optimizer, LR schedule and step counter of one rank.

    Without ``optim`` the trainer is forward-only (e.g. a reference policy for ``ref_logprobs``).
    """

    def __init__(self, model: ModelConfig, train: TrainConfig, groups: ParallelGroups,
                 optim: Optional[OptimConfig] = None, *, load_weights: bool = True) -> None:
        self.cfg, self.optim_cfg, self.groups = train, optim, groups
        pp = groups.layout.pp
        self.built: BuiltModel = build_model(pipeline_ready(model, pp), groups, load_weights=load_weights)
        tc = self.built.tconfig
        self._same_length = pp > 1 and not tc.variable_seq_lengths
        sp = tc.sequence_parallel and groups.layout.tp > 1
        cp = groups.layout.cp
        # each CP rank's share of a row / stream must split over TP under sequence parallelism
        self._pad_multiple = math.lcm(train.pad_to_multiple, (groups.layout.tp if sp else 1) * cp)
        self.work = WorkModel.from_arch(self.built.arch)
        self._mp_group = ps.get_model_parallel_group()  # read once, at the edge
        self.routing = TrainerRouting(self)  # MoE routing replay, agreement metrics, the routing mask's input
        self.ref: Optional[BuiltModel] = None
        if train.reference_model is not None:
            self.ref = build_model(pipeline_ready(train.reference_model, pp), groups)
            self.ref.module.eval()
            self.ref.module.requires_grad_(False)
            if self.ref.padded_vocab_size != self.built.padded_vocab_size:
                raise ValueError(f"reference model vocabulary ({self.ref.vocab_size}) differs from the policy's "
                                 f"({self.built.vocab_size})")
        if train.fused_head:
            for built in (self.built, self.ref):
                if built is not None:
                    head.check_supported(built.module)
        self.ddp = self.optimizer = self.schedule = None
        if optim is not None:
            self.ddp, self.optimizer = build_ddp_and_optimizer(self.built.module, tc, optim)
            self.schedule = LRSchedule(optim.schedule)
        self.step = 0  # successful optimizer steps
        self.skipped_steps = 0
        self.lr: Optional[float] = None
        # progress(desc, done, total, unit): set by the caller that draws bars (one rank per job suffices)
        self.progress: Optional[Callable[[str, int, int, str], None]] = None

    # ------------------------------------------------------------------------------------------
    # Public API
    # ------------------------------------------------------------------------------------------
    @property
    def module(self):
        """This rank's GPTModel stage (unwrapped)."""
        return self.built.module

    @torch.no_grad()
    def forward(self, batch: TrainBatch, objective: Optional[ObjectiveConfig] = None) -> ForwardResult:
        """Forward-only pass: per-response-token log-prob, entropy and Σπ² (plus DVP / reference-KL fields)
        of the current weights, on every rank of this data-parallel replica. ``objective``: as in
        :meth:`train_step` (it sets e.g. the direction of ``ref_kl``)."""
        with self._objective(objective):
            mbs, batch_metrics = self._micro_batches(batch, forward_only=True)
            ref = self._reference_logits(mbs)
            tracker = self.routing.tracker(batch)
            payloads = self._stats_pass(mbs, ref, tracker)
            result = self.routing.finish_forward(self._assemble(batch, mbs, payloads), batch, tracker)
            result.metrics.update(batch_metrics)
            return result

    def train_step(self, batch: TrainBatch, objective: Optional[ObjectiveConfig] = None) -> StepResult:
        """One optimizer step on this replica's batch (collective over the whole job).

        ``objective`` replaces ``TrainConfig.objective`` for this call only — how a run switches from an
        imitation warm-up (dense KL to the reference) to the RL loss without rebuilding the trainer. A
        reference model it needs must have been configured (``TrainConfig.reference_model``); reference
        logits are computed only when the step's objective uses them.
        """
        with self._objective(objective):
            return self._train_step(batch)

    @contextlib.contextmanager
    def _objective(self, objective: Optional[ObjectiveConfig]):
        if objective is None or objective == self.cfg.objective:
            yield
            return
        base = self.cfg
        self.cfg = dataclasses.replace(base, objective=objective)  # re-validated (e.g. a reference it needs)
        try:
            yield
        finally:
            self.cfg = base

    def _train_step(self, batch: TrainBatch) -> StepResult:
        if self.optimizer is None:
            raise ValueError("this PolicyTrainer was built without an OptimConfig: it can only run forward()")
        cfg, groups = self.cfg, self.groups
        if batch.advantages is None:
            raise ValueError("train_step needs TrainBatch.advantages (per-token [B, R])")
        if cfg.objective.policy.mode == "decoupled" and batch.old_logprobs is None:
            raise ValueError("policy.mode='decoupled' needs TrainBatch.old_logprobs: run trainer.forward(batch) first "
                             "and pass batch.replace(old_logprobs=result.logprobs), or use policy.mode='bypass'")
        batch = self.routing.prepare(batch)  # the routing mask's input, if it needs one and it is missing
        mbs, batch_metrics = self._micro_batches(batch, forward_only=False)
        self._check_same_count_over_dp(len(mbs))
        routing_metrics = self.routing.before_step(batch, mbs)  # diagnostics at the pre-update weights
        lr_before = self.lr
        lr, schedule_before = self._begin_lr(batch)
        ref = self._reference_logits(mbs) if cfg.needs_reference_logits else None
        # Under CP every rank holds all response columns, its own tokens selected by the mask.
        reduce_groups = ReduceGroups(cp=groups.cp if groups.layout.cp > 1 else None, dp=groups.dp, cp_zigzag=False)
        normalizer = self._step_normalizer(mbs, ref, reduce_groups)
        # Megatron divides by M and DDP by dp*cp: see the module docstring.
        scale = len(mbs) * dist.get_world_size(groups.dp_cp) / groups.layout.cp

        def loss_fn(logits, mb: MicroBatch, k: int):
            loss, metrics, bad = loss_glue.micro_batch_loss(
                logits, mb, cfg, tp_group=groups.tp, vocab_size=self.built.vocab_size, groups=reduce_groups,
                normalizer=normalizer, ref_logits=None if ref is None else ref[k], **self._head_weights())
            payload = {"loss": float(loss.detach()), "nonfinite": int(bad),
                       "metrics": {n: float(v) for n, v in metrics.items()}}
            return loss * scale, payload

        zero_grads(self.ddp, self.optimizer)
        self.ddp.train()
        tracker = self.routing.tracker(batch)
        with self.routing.routes(self.built, mbs, tracker) as set_routes, self._head_out(self.built):
            payloads = run_micro_batches(self.ddp, mbs, loss_fn, forward_only=False, before_forward=set_routes,
                                         on_micro_batch=self._ticker("train micro-batches", len(mbs)))
        loss, n_bad = self._step_loss(payloads)
        applied, grad_norm, bad_weights = guarded_step(
            self.optimizer, self.optim_cfg.clip_grad, math.isfinite(loss) and n_bad == 0,
            params=self.module.parameters(), rollback=self.optim_cfg.nonfinite_weights == "rollback")
        if applied:
            self.step += 1
        else:
            # Nothing moved: weights, optimizer state and the LR schedule stay as they were.
            self.schedule.load_state_dict(schedule_before)
            self.lr = lr_before
            zero_grads(self.ddp, self.optimizer)
            self.skipped_steps += 1
        metrics = None
        if self.built.post_process:
            metrics = merge_micro_batch_metrics([p["metrics"] for p in payloads])
            metrics["train/nonfinite_policy_tokens"] = float(n_bad)
        loss, metrics = self._from_last_stage((loss, metrics))
        metrics["train/skipped_steps"] = float(self.skipped_steps)
        metrics["train/nonfinite_weights"] = float(bad_weights)
        if not applied and dist.get_rank() == 0:
            why = (f"the update made the weights non-finite at lr {lr:.3g} (rolled back)" if bad_weights else
                   f"non-finite loss or gradient (loss {loss:.4g}, grad norm {grad_norm:.4g}, "
                   f"{metrics['train/nonfinite_policy_tokens']:.0f} non-finite policy tokens)")
            logger.warning("train step skipped after %d optimizer steps: %s; %d step(s) skipped so far",
                           self.step, why, self.skipped_steps)
        metrics.update(self.schedule.metrics())  # the length-surge state (the run report plots it)
        metrics.update(batch_metrics)
        metrics.update(self.routing.after_step(batch, tracker, metrics, routing_metrics))
        return StepResult(step=self.step, loss=loss, grad_norm=grad_norm, lr=lr, skipped=not applied,
                          skipped_steps=self.skipped_steps, metrics=metrics)

    def _step_normalizer(self, mbs: List[MicroBatch], ref, reduce_groups: ReduceGroups):
        """The step's Normalizer (last stage; None elsewhere), from every micro-batch's selection. Needs a
        forward pass of the current policy only when the selection reads it (all stages take part)."""
        cfg = self.cfg
        current = self._stats_pass(mbs, ref) if loss_glue.normalizer_needs_current_policy(cfg) else None
        if not self.built.post_process:
            return None
        records = [loss_glue.normalizer_inputs(mb, cfg, current[k] if current else None) for k, mb in enumerate(mbs)]
        return step_normalizer(records, cfg.objective, reduce_groups)

    def _step_loss(self, payloads):
        """``(step loss, non-finite policy tokens)``, summed over micro-batches, DP and CP (CP ranks score
        disjoint tokens; last stage; 0 elsewhere: the skip decision is all-reduced in :func:`guarded_step`)."""
        if not self.built.post_process:
            return 0.0, 0
        t = torch.tensor([sum(p["loss"] for p in payloads), sum(p["nonfinite"] for p in payloads)], dtype=torch.float64)
        self._all_reduce(t, dist.ReduceOp.SUM, self.groups.dp_cp)
        return float(t[0]), int(t[1])

    # ------------------------------------------------------------------------------------------
    # Learning rate
    # ------------------------------------------------------------------------------------------
    def _begin_lr(self, batch: TrainBatch):
        """Step the schedule with this step's global mean response length and push the LR into the
        optimizer. Returns ``(lr, schedule state before the step)`` so a skipped step can undo it."""
        before = copy.deepcopy(self.schedule.state_dict())
        length = global_mean_response_length(batch.response_mask, self.groups.dp)  # identical on all ranks
        lr = self.schedule.step(length)
        lr = broadcast_scalar(lr, dist.group.WORLD)  # computed everywhere; rank 0's value is the one used
        set_lr(self.optimizer, lr)
        self.lr = lr
        return lr, before
