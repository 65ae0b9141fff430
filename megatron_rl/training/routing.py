"""The PolicyTrainer's MoE routing glue (one :class:`TrainerRouting` per trainer).

* :meth:`TrainerRouting.routes` — the before-forward hook of one pass: replays ``routed_experts``
  (``TrainConfig.routing_replay``) in the train step, the old-log-prob pass (``forward``) and the
  reference model's pass (the batch's ``route_checksums`` are checked against its tokens first, in
  :meth:`TrainerRouting.check_batch`); records the trainer's own routing for agreement when a tracker
  is given. Routes follow the micro-batch's token layout (padded rows, a packed stream, this
  context-parallel rank's zigzag chunks: :mod:`megatron_rl.training.micro_batch`).
* :meth:`TrainerRouting.prepare` — fills ``TrainBatch.routing_disagreement`` (one forward-only pass)
  when ``objective.routing_mask`` is on and the batch does not carry it (pass
  ``ForwardResult.routing_disagreement`` along with ``old_logprobs`` to avoid the extra pass).
* metrics: ``routing/agreement_layer{i}``, ``routing/agreement_mean``, ``routing/mismatch_k3``,
  ``routing/logprob_abs_diff`` every step; ``routing/replayed_tokens`` with replay (token positions whose
  experts the train step's forward forced, over the whole batch: each one counted once per MoE layer
  it was forced at, divided by the number of MoE layers); ``routing/no_replay/*`` with
  ``routing_diagnostics.without_replay`` (one more forward-only pass, before the update).

All metrics are global (reduced over DP and PP) and identical on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from megatron_rl import parallel
from megatron_rl.models.router import record_routing, replay_routing, tokens_from_batch_major
from megatron_rl.routing.agreement import AgreementTracker, mismatch_metrics, mismatch_sums, reduce_sum
from megatron_rl.routing.align import RoutingLayout, check_route_checksums
from megatron_rl.training import loss_glue
from megatron_rl.training.pipeline import run_micro_batches


def _moe_layers(built) -> List[int]:
    return [i for i, m in enumerate(built.arch.moe_layers) if m]


def _router_access(built) -> bool:
    return built.arch.is_moe and bool(built.tconfig.moe_enable_routing_replay)


class TrainerRouting:
    def __init__(self, trainer) -> None:
        self._t = trainer
        built = trainer.built
        self.available = _router_access(built)
        self.moe_layers = _moe_layers(built)
        self.layout = RoutingLayout.from_arch(built.arch) if built.arch.is_moe else None
        self._replayed: Optional[int] = None  # (token, layer) pairs the last replayed pass of the policy forced
        if trainer.cfg.routing_replay and not self.available:
            raise ValueError("train.routing_replay needs an MoE model built with ModelConfig.routing_replay=True")
        if trainer.cfg.objective.routing_mask.enabled and not self.available:
            raise ValueError("objective.routing_mask needs an MoE model built with ModelConfig.routing_replay=True "
                             "(the trainer reads its routers' choices)")

    @property
    def cfg(self):
        return self._t.cfg  # read per call: the trainer may override the objective for one call

    def _uses(self, batch) -> bool:
        return self.available and batch.routed_experts is not None

    def check_batch(self, batch) -> None:
        """``routed_experts`` must be ``[B, L, num_moe_layers, topk]`` for this model, and (with replay) its
        rows recorded for the rows' tokens (``route_checksums``): checked before any forward, so every rank
        fails, not one mid-schedule."""
        if batch.routed_experts is None or self.layout is None:
            return
        want = (self.layout.num_moe_layers, self.layout.topk)
        got = tuple(batch.routed_experts.shape[2:])
        if got != want:
            raise ValueError(f"TrainBatch.routed_experts has {got[0]} MoE layers x top-{got[1]}, but the trainer's "
                             f"model has {want[0]} MoE layers x top-{want[1]} (expected [B, L, {want[0]}, {want[1]}], "
                             f"got {tuple(batch.routed_experts.shape)})")
        if self.cfg.routing_replay and batch.route_checksums is not None:
            inside = torch.arange(batch.input_ids.shape[1])[None, :] < batch.seq_lengths[:, None]
            check_route_checksums(torch.where(inside, batch.input_ids, 0), batch.route_checksums)

    # ---- passes --------------------------------------------------------------------------------
    def tracker(self, batch) -> Optional[AgreementTracker]:
        """An agreement tracker for one pass over ``batch`` (None when nothing needs it)."""
        if not self._uses(batch):
            return None
        if not (self.cfg.routing_diagnostics.agreement or self.cfg.objective.routing_mask.enabled):
            return None
        self.check_batch(batch)
        B, R = batch.response_mask.shape
        return AgreementTracker(B, R, self.moe_layers, device=parallel.device())

    @contextlib.contextmanager
    def routes(self, built, mbs, tracker: Optional[AgreementTracker] = None) -> Iterator:
        """Yields the before-forward hook (or None) of one pass of ``mbs`` through ``built``'s stage;
        on exit, adds the pass's routing to ``tracker``."""
        replay = self.cfg.routing_replay and _router_access(built)
        if replay:
            layers = _moe_layers(built)
            order: List = []
            with replay_routing(built, shadow=tracker is not None) as replayer:
                def set_routes(mb) -> None:
                    replayer.set({layer: tokens_from_batch_major(mb.routed_experts[:, :, i])
                                  for i, layer in enumerate(layers)})
                    order.append(mb)

                yield set_routes
            if built is self._t.built:  # not the reference model's pass
                self._replayed = replayer.replayed
            if tracker is not None:
                tracker.collect(order, replayer.shadow)
        elif tracker is not None:
            order = []
            with record_routing(built) as record:
                yield order.append
            tracker.collect(order, record)
        else:
            yield None

    def prepare(self, batch):
        """``batch`` with ``routing_disagreement`` when the routing mask needs it (one forward pass)."""
        if not self.cfg.objective.routing_mask.enabled or batch.routing_disagreement is not None:
            return batch
        if batch.routed_experts is None:
            raise ValueError("objective.routing_mask is enabled but TrainBatch.routed_experts is None: request "
                             "routed experts from the rollout engine (megatron_rl.routing.attach_routes)")
        return batch.replace(routing_disagreement=self._t.forward(batch).routing_disagreement)

    # ---- metrics -------------------------------------------------------------------------------
    def finish_forward(self, result, batch, tracker: Optional[AgreementTracker]):
        """``ForwardResult`` with ``routing_disagreement`` and ``routing/*`` metrics (collective)."""
        if not self._uses(batch):
            return result
        metrics: Dict[str, float] = {}
        disagreement = None
        if tracker is not None:
            disagreement, metrics = tracker.finalize(self._t.groups)
            disagreement = torch.where(batch.response_mask, disagreement, torch.zeros(()))
        if batch.rollout_logprobs is not None:
            sums = reduce_sum(mismatch_sums(result.logprobs, batch.rollout_logprobs, batch.response_mask),
                              self._t.groups.dp)
            metrics.update(mismatch_metrics(sums))
        return dataclasses.replace(result, routing_disagreement=disagreement, metrics={**result.metrics, **metrics})

    def before_step(self, batch, mbs) -> Dict[str, float]:
        """Pre-update diagnostics of a train step: the pass without replay, if configured."""
        if not (self._uses(batch) and self.cfg.routing_replay and self.cfg.routing_diagnostics.without_replay):
            return {}
        return self.without_replay(batch, mbs)

    @torch.no_grad()
    def without_replay(self, batch, mbs) -> Dict[str, float]:
        """One forward-only pass with the trainer's own routing: ``routing/no_replay/*`` metrics."""
        t = self._t
        self.check_batch(batch)
        tracker = AgreementTracker(*batch.response_mask.shape, self.moe_layers, device=parallel.device())

        def loss_fn(logits, mb, k):
            st = loss_glue.token_stats(logits, mb, t.cfg, tp_group=t.groups.tp, vocab_size=t.built.vocab_size)
            return logits.new_zeros(()), st.logprobs.detach()

        stage = t.ddp if t.ddp is not None else t.built.module
        stage.eval()
        order: List = []
        with record_routing(t.built) as record:
            payloads = run_micro_batches(stage, mbs, loss_fn, forward_only=True, before_forward=order.append)
        tracker.collect(order, record)
        _, metrics = tracker.finalize(t.groups, prefix="routing/no_replay/", tokens=False)
        if batch.rollout_logprobs is not None:
            sums = torch.zeros(3, dtype=torch.float64, device=parallel.device())
            for mb, lp in zip(mbs, payloads):  # last stage only; empty elsewhere
                sums += mismatch_sums(lp.float(), mb.rollout_logprobs, mb.response_mask)
            metrics.update(mismatch_metrics(reduce_sum(sums, t.groups.pp, t.groups.dp, t.groups.cp),
                                            prefix="routing/no_replay/"))
        return metrics

    def _replayed_tokens(self, pairs: int) -> float:
        """Forced (token, layer) pairs of one pass, summed over the job, per MoE layer (collective). Each
        rank routes its own tokens (a DP/CP share, a sequence-parallel shard of TP) at its own stage's
        layers, so the sum runs over DP x CP, PP and, with sequence parallelism, TP."""
        g, built = self._t.groups, self._t.built
        sp = built.tconfig.sequence_parallel and dist.get_world_size(g.tp) > 1
        t = reduce_sum(torch.tensor([float(pairs)], dtype=torch.float64), g.tp if sp else None, g.pp, g.dp_cp)
        return float(t) / max(len(self.moe_layers), 1)

    def after_step(self, batch, tracker: Optional[AgreementTracker], step_metrics: Dict[str, float],
                   pre: Dict[str, float]) -> Dict[str, float]:
        """The step's ``routing/*`` metrics (collective): agreement of the step's forward, the with-replay
        mismatch (the objective's ``mismatch/k3`` / ``mismatch/abs_diff``: the trainer's log-probs at the
        step's weights vs μ), and ``pre`` (:meth:`before_step`)."""
        if not self._uses(batch):
            return {}
        out = dict(pre)
        if tracker is not None:
            out.update(tracker.finalize(self._t.groups, tokens=False)[1])
        if self.cfg.routing_replay and self._replayed is not None:
            out["routing/replayed_tokens"] = self._replayed_tokens(self._replayed)
            self._replayed = None
        for src, dst in (("mismatch/k3", "routing/mismatch_k3"), ("mismatch/abs_diff", "routing/logprob_abs_diff")):
            if src in step_metrics:
                out[dst] = step_metrics[src]
        return out
