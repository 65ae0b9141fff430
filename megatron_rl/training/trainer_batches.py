"""PolicyTrainer's micro-batches: this rank's share of a batch (fixed count or token-budget packing), the
checks that every rank of a replica got the same batch, and the batch metrics (mixed into
:class:`~megatron_rl.training.trainer.PolicyTrainer`, whose ``__init__`` sets the state)."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from megatron_rl import parallel
from megatron_rl.training.batch import MicroBatch, TrainBatch
from megatron_rl.training.micro_batch import build_micro_batches, fixed_size_groups, packed_lengths, stream_multiple
from megatron_rl.training.placement import micro_batches_to
from megatron_rl.training.token_budget import imbalance, pack


class TrainerBatches:
    """Micro-batch planning and batch checks of PolicyTrainer."""

    def _micro_batches(self, batch: TrainBatch, forward_only: bool) -> Tuple[List[MicroBatch], Dict[str, float]]:
        """This rank's micro-batches of ``batch`` — a fixed count, or packed under the pass's token budget
        with the same count on every DP rank — and the pass's ``batch/*`` metrics (collective over DP)."""
        if not isinstance(batch, TrainBatch):
            raise ValueError(f"expected a TrainBatch, got {type(batch).__name__}")
        self._check_batch(batch)
        cfg, lay = self.cfg, self.groups.layout
        tokens = (packed_lengths(batch.seq_lengths, lay.cp) if cfg.packing else batch.seq_lengths).tolist()
        work = self.work(tokens)
        budget, field = cfg.token_budget_of(forward_only)
        if budget:
            plan = dict(cap=budget * lay.cp, multiple=stream_multiple(self._pad_multiple, lay.cp), field=field,
                        cp=lay.cp)
            bins = pack(tokens, work, **plan)
            count = torch.tensor([len(bins)], dtype=torch.int64)
            self._all_reduce(count, dist.ReduceOp.MAX, self.groups.dp)  # the same count on every DP rank
            if int(count) != len(bins):
                bins = pack(tokens, work, count=int(count), **plan)
            groups = [torch.tensor(g, dtype=torch.long) for g in bins]
        else:
            groups = fixed_size_groups(batch, cfg.micro_batch_size, cfg.group_by_length)
        mbs = build_micro_batches(batch, groups, pad_multiple=self._pad_multiple, same_length=self._same_length,
                                  packed=cfg.packing, cp_size=lay.cp, cp_rank=self.groups.cp_rank)
        mbs = micro_batches_to(mbs, parallel.device())  # built on the host; every pass computes on the device
        return mbs, self._batch_metrics(mbs, sum(work), "batch/forward_" if forward_only else "batch/")

    def _batch_metrics(self, mbs: List[MicroBatch], work: float, prefix: str) -> Dict[str, float]:
        """``padding_frac`` (padding share of the positions computed), ``dp_imbalance`` (max / mean estimated
        work over DP ranks), ``micro_batches`` (per rank), over the whole pass; one all-reduce over DP."""
        dp = dist.get_world_size(self.groups.dp)
        buf = torch.zeros(2 + dp, dtype=torch.float64)
        buf[0] = sum(mb.token_slots for mb in mbs)
        buf[1] = sum(mb.real_tokens for mb in mbs)
        buf[2 + self.groups.dp_rank] = work
        self._all_reduce(buf, dist.ReduceOp.SUM, self.groups.dp)
        return {f"{prefix}padding_frac": float(1 - buf[1] / buf[0].clamp(min=1)),
                f"{prefix}dp_imbalance": imbalance(buf[2:].tolist()), f"{prefix}micro_batches": float(len(mbs))}

    def _check_batch(self, batch: TrainBatch) -> None:
        arch = self.built.arch
        lengths = batch.seq_lengths
        longest = int(lengths.max()) if batch.batch_size else 0
        if longest > arch.max_position_embeddings:
            raise ValueError(f"a sequence of {longest} tokens exceeds the model's max_position_embeddings="
                             f"{arch.max_position_embeddings}; truncate or filter long samples")
        inside = torch.arange(batch.input_ids.shape[1])[None, :] < lengths[:, None]
        ids = batch.input_ids[inside]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.built.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.built.vocab_size}); got [{int(ids.min())}, "
                             f"{int(ids.max())}]")
        if self.cfg.routing_replay and batch.routed_experts is None:
            raise ValueError("train.routing_replay=True but TrainBatch.routed_experts is None")
        self.routing.check_batch(batch)
        # All TP/PP ranks of a replica must feed the same batch (else: hangs or silent garbage).
        sums = [batch.batch_size, batch.input_ids.shape[1], int(ids.sum()), int(lengths.sum()),
                int(batch.response_mask.sum())]
        t = torch.tensor(sums + [-v for v in sums], dtype=torch.int64)
        self._all_reduce(t, dist.ReduceOp.MAX, self._mp_group)
        if t[: len(sums)].tolist() != [-v for v in t[len(sums):].tolist()]:
            raise ValueError("the tensor/pipeline-parallel ranks of one data-parallel replica were given different "
                             "batches; every rank of a replica must receive the same TrainBatch")

    def _check_same_count_over_dp(self, count: int) -> None:
        t = torch.tensor([count, -count], dtype=torch.int64)
        self._all_reduce(t, dist.ReduceOp.MAX, self.groups.dp)
        if int(t[0]) != -int(t[1]):
            raise ValueError(f"data-parallel ranks have between {-int(t[1])} and {int(t[0])} micro-batches; every rank "
                             "needs the same number (equal per-rank batch sizes)")

    @staticmethod
    def _all_reduce(t: torch.Tensor, op, group) -> None:
        if dist.get_world_size(group) > 1:
            if dist.get_backend(group) == "nccl":
                moved = t.cuda()
                dist.all_reduce(moved, op=op, group=group)
                t.copy_(moved.cpu())
            else:
                dist.all_reduce(t, op=op, group=group)

