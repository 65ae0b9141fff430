"""The trainer's phases of a step: old / reference log-probs, advantages, the training step, the gain
diagnostic. What a step needs is worked out once, in :meth:`TrainingPhase.plan`: the step's objective (the
warm-up has its own) and the passes it asks for (:class:`~megatron_rl.objectives.StepPasses`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Tuple

from megatron_rl import perf
from megatron_rl.config import RunConfig
from megatron_rl.diagnostics import gain_decomposition
from megatron_rl.metrics import PhaseTimer
from megatron_rl.objectives import ObjectiveConfig, StepPasses
from megatron_rl.orchestration import batching
from megatron_rl.orchestration.rollout_phase import RolloutBatch
from megatron_rl.orchestration.trainer_group import TrainerGroup


@dataclass(frozen=True)
class StepPlan:
    step: int
    objective: ObjectiveConfig
    passes: StepPasses
    warmup: bool  # the imitation warm-up: no dynamic-sampling filter, imitation-only advantages


class TrainingPhase:
    def __init__(self, cfg: RunConfig, trainers: TrainerGroup, timer: PhaseTimer, flops: perf.ModelFlops):
        self.cfg, self.trainers, self.timer, self.flops = cfg, trainers, timer, flops
        self._ref_logprobs = cfg.train.objective.needs_sample_kl_reference  # the trainer holds that reference

    def is_warmup(self, step: int) -> bool:
        return step <= self.cfg.warmup.steps

    def plan(self, step: int) -> StepPlan:
        objective = self.cfg.objective_at(step)
        passes = StepPasses.of(objective, advantage_estimator=self.cfg.advantage.estimator,
                               gain=self.cfg.diagnostics.gain, ref_logprobs=self._ref_logprobs)
        return StepPlan(step, objective, passes, self.is_warmup(step))

    def logprobs(self, tb, plan: StepPlan) -> Tuple[Any, Any, Dict[str, float]]:
        """Old (and reference) log-probs of the batch under the current weights."""
        with self.timer.phase("logprobs"):
            fwd = self.trainers.forward(tb, plan.objective) if plan.passes.forward else None
            ref = self.trainers.ref_logprobs(tb) if plan.passes.ref_logprobs else None
        # forward passes: the policy's (+ its reference model's logits) and the sample-KL reference's
        passes = (0 if fwd is None else 1 + (self.cfg.train.reference_model is not None)) + (ref is not None)
        flops = {"perf/logprob_flops": passes * self.batch_flops(tb)}
        if fwd is None:
            return tb.replace(ref_logprobs=ref), None, flops
        tb = tb.replace(old_logprobs=fwd.logprobs, ref_logprobs=ref, routing_disagreement=fwd.routing_disagreement)
        return tb, fwd, {**batching.forward_metrics(tb, fwd, plan.objective), **fwd.metrics, **flops}

    def advantages(self, tb, fwd, batch: RolloutBatch, plan: StepPlan):
        with self.timer.phase("advantages"):
            rewards = [x for g in batch.groups for x in g.rewards]
            per_token = [t for g in batch.groups for t in (g.token_rewards or [None] * len(g.rewards))]
            adv, metrics = batching.compute_step_advantages(
                self.cfg.advantage, plan.objective, tb, rewards, fwd, imitation_only=plan.warmup,
                ref_logprobs=tb.ref_logprobs, per_token=per_token)
        return tb.replace(advantages=adv), metrics

    def train(self, tb, plan: StepPlan) -> Dict[str, float]:
        with self.timer.phase("train"):
            result = self.trainers.train_step(tb, plan.objective, version=plan.step)
        out = {"train/grad_norm": result.grad_norm, "train/lr": result.lr,
               "train/skipped": float(result.skipped), "train/optimizer_step": float(result.step),
               "train/tokens": float(tb.seq_lengths.sum()), "train/sequences": float(tb.batch_size),
               "train/warmup": float(plan.warmup)}
        if not result.skipped:  # a skipped step trained nothing: no loss to show
            out["train/loss"] = result.loss
        # forward + backward (+ the reference's forward)
        out["perf/train_flops"] = (3 + plan.passes.reference_logits) * self.batch_flops(tb)
        out.update(result.metrics)
        return out

    def gain(self, tb, batch: RolloutBatch, plan: StepPlan) -> Dict[str, float]:
        """``diagnostics.gain``: the update's gain decomposition (math_spec §h.3) from a forward of the same
        batch under the new weights against its old log-probs (``megatron_rl.diagnostics``)."""
        if not plan.passes.gain or tb.old_logprobs is None:
            return {}
        with self.timer.phase("diagnostics"):
            new = self.trainers.forward(tb, plan.objective)
            rewards = [x for g in batch.groups for x in g.rewards]
            return {**gain_decomposition(rewards, tb.group_ids, tb.old_logprobs, new.logprobs, tb.response_mask,
                                         self.cfg.diagnostics.reward_max),
                    "perf/diagnostics_flops": self.batch_flops(tb)}

    def batch_flops(self, tb) -> float:
        """Forward FLOPs of the policy over the batch's sequences."""
        lengths = tb.seq_lengths.tolist()
        return self.flops.forward(float(sum(lengths)), perf.sum_sq(lengths))
