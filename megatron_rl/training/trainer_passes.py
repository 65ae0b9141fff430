"""PolicyTrainer's passes: the fused head's inputs, the reference model's logits, the statistics pass and
the assembly of a forward's results on every rank (mixed into :class:`~megatron_rl.training.trainer.PolicyTrainer`,
whose ``__init__`` sets the state)."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_rl import parallel
from megatron_rl.models.build import BuiltModel
from megatron_rl.training import head, loss_glue
from megatron_rl.training.batch import MicroBatch, TrainBatch
from megatron_rl.training.pipeline import run_micro_batches
from megatron_rl.training.results import ForwardResult


class TrainerPasses:
    """Forward passes of PolicyTrainer outside the train step."""

    def _head_out(self, built: BuiltModel):
        """With ``train.fused_head`` the stage returns the output layer's input (:mod:`.head`)."""
        return head.hidden_states_out(built.module, self.cfg.fused_head)

    def _head_weights(self) -> Dict[str, Optional[torch.Tensor]]:
        """The output weights the fused head's statistics need (last stage), as loss-glue keywords."""
        if not self.cfg.fused_head:
            return {}
        return {"weight": head.output_weight(self.built.module),
                "ref_weight": None if self.ref is None else head.output_weight(self.ref.module)}

    @torch.no_grad()
    def _reference_logits(self, mbs: List[MicroBatch]) -> Optional[List[torch.Tensor]]:
        """Reference logits ``[b, s, V_local]`` of every micro-batch (last stage; empty list elsewhere); with
        the fused head its output layer's input ``[b, s, H]`` instead (V/H times smaller)."""
        if self.ref is None:
            return None
        with self.routing.routes(self.ref, mbs) as set_routes, self._head_out(self.ref):  # rollout routes too
            return run_micro_batches(self.ref.module, mbs,
                                     lambda logits, mb, k: (logits.new_zeros(()), logits.detach()),
                                     forward_only=True, before_forward=set_routes)

    @torch.no_grad()
    def _stats_pass(self, mbs: List[MicroBatch], ref, tracker=None) -> List[Dict[str, torch.Tensor]]:
        """Forward-only token statistics of every micro-batch (last stage; empty list elsewhere); ``tracker``
        collects the pass's routing agreement."""
        cfg, groups = self.cfg, self.groups

        def loss_fn(logits, mb: MicroBatch, k: int):
            st = loss_glue.token_stats(logits, mb, cfg, tp_group=groups.tp, vocab_size=self.built.vocab_size,
                                       ref_logits=None if ref is None else ref[k], **self._head_weights())
            return logits.new_zeros(()), st.detached()

        stage = self.ddp if self.ddp is not None else self.built.module
        stage.eval()
        with self.routing.routes(self.built, mbs, tracker) as set_routes, self._head_out(self.built):
            return run_micro_batches(stage, mbs, loss_fn, forward_only=True, before_forward=set_routes,
                                     on_micro_batch=self._ticker("forward micro-batches", len(mbs)))

    def _ticker(self, desc: str, total: int) -> Optional[Callable[[int], None]]:
        report = self.progress
        return None if report is None else (lambda done: report(desc, done, total, "mb"))

    def _result_keys(self) -> List[str]:
        keys = ["logprobs", "entropy", "sum_pi_squared"]
        if self.cfg.objective.dvp.enabled:
            keys += ["full_logprobs", "kept_mass", "target_kept"]
        if self.ref is not None:
            keys.append("ref_kl")
        return keys

    def _assemble(self, batch: TrainBatch, mbs: List[MicroBatch], payloads) -> ForwardResult:
        keys = self._result_keys()
        B, R = batch.response_mask.shape
        buf = torch.zeros(len(keys), B, R, dtype=torch.float32, device=parallel.device())
        for mb, stats in zip(mbs, payloads):
            r = mb.response_mask.shape[1]
            for i, key in enumerate(keys):  # this rank's tokens only (under CP, the others score the rest)
                buf[i, mb.rows, :r] = torch.where(mb.response_mask, stats[key].float(), 0.0)
        buf = torch.where(batch.response_mask.to(buf.device), buf, torch.zeros((), dtype=buf.dtype))
        if self.groups.layout.cp > 1 and self.built.post_process:  # CP ranks filled disjoint tokens
            self._all_reduce(buf, dist.ReduceOp.SUM, self.groups.cp)
        pp = self.groups.layout.pp
        if pp > 1:  # the last stage computed it: give it to every stage of the replica
            src = dist.get_global_rank(self.groups.pp, pp - 1)
            dist.broadcast(buf, src=src, group=self.groups.pp)
        buf = buf.cpu()  # the driver's side: one copy back
        fields = dict(zip(keys, buf))
        if "target_kept" in fields:
            fields["target_kept"] = fields["target_kept"] > 0.5
        return ForwardResult(response_mask=batch.response_mask, **fields)

    def _from_last_stage(self, obj):
        pp = self.groups.layout.pp
        if pp == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.groups.pp, pp - 1), group=self.groups.pp)
        return box[0]

