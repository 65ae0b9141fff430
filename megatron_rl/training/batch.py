"""The trainer's batch record and its split into micro-batches.

:class:`TrainBatch` holds one data-parallel rank's sequences (prompt + response) as right-padded
tensors, with every per-token quantity aligned to *response* positions: column ``j`` of a
``[B, R]`` field belongs to response token ``j`` of its sequence, i.e. token ``P_i + j`` of
``input_ids`` (``P_i`` the prompt length). That is the layout the rollout engine produces and the one
:class:`megatron_rl.objectives.LossInputs` consumes, so no index bookkeeping leaks into the driver.

How the sequences of a batch become micro-batches (padded or packed, split over context-parallel
ranks) is :mod:`megatron_rl.training.micro_batch`; which sequences share one (a fixed count, or a token
budget balanced over data-parallel ranks) is :mod:`megatron_rl.training.token_budget`.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch

from megatron_rl.objectives.records import BATCH_TOKEN_FIELDS, BatchTokens
from megatron_rl.training.micro_batch import MicroBatch, make_micro_batches, num_micro_batches  # noqa: F401

Tensor = torch.Tensor


def _flat(v) -> list:
    """A sequence item (list, tuple, tensor or scalar) as a flat python list."""
    if isinstance(v, torch.Tensor):
        return v.reshape(-1).tolist()
    if isinstance(v, (list, tuple)):
        return list(v)
    return [v.item() if hasattr(v, "item") else v]


@dataclass
class TrainBatch(BatchTokens):
    """Sequences of one data-parallel rank for one optimizer step (or one forward pass). The per-token fields
    (``advantages`` ... ``policy_version``) are :class:`~megatron_rl.objectives.records.BatchTokens`'.

    Attributes:
        input_ids: ``[B, L]`` int64 prompt + response token ids, right-padded (any id beyond the length).
        prompt_lengths: ``[B]`` tokens of prompt (>= 1: the first response token needs a context).
        response_lengths: ``[B]`` tokens of response; ``prompt_lengths + response_lengths <= L``.
        response_mask: ``[B, R]`` bool loss mask over response positions: True for model-generated tokens,
            False for tool/observation tokens and for padding (``j >= response_lengths``, enforced).
        advantages: ``[B, R]`` per-token advantages.
        rollout_logprobs: ``[B, R]`` log μ of each response token from the rollout engine (bypass mode,
            rollout correction, TRM).
        old_logprobs: ``[B, R]`` log π_old from :meth:`PolicyTrainer.forward` (decoupled mode).
        ref_logprobs: ``[B, R]`` log π_ref of the sampled tokens (sample-based KL penalties).
        routed_experts: ``[B, L, num_moe_layers, topk]`` expert ids the rollout engine chose at each input
            position (prompt and response), MoE layers in model order; for routing replay. A row of -1
            leaves that token to the trainer's router (``megatron_rl.routing.align``).
        group_ids: ``[B]`` prompt group of each sequence (GRPO groups); carried, not used by the loss.
        route_checksums: ``[B]`` int64 checksum of the tokens each ``routed_experts`` row was recorded for
            (``megatron_rl.routing.attach_routes``); checked against each micro-batch's tokens before replay.
        routing_disagreement: ``[B, R]`` per-token trainer-vs-engine routing disagreement (fraction of MoE
            layers), from :meth:`PolicyTrainer.forward`; for ``objective.routing_mask``.
        policy_version: ``[B, R]`` int64 weight version that sampled each response token (-1: padding);
            ``LossInputs.policy_version``.
    """

    input_ids: Tensor
    prompt_lengths: Tensor
    response_lengths: Tensor
    response_mask: Tensor
    routed_experts: Optional[Tensor] = None
    group_ids: Optional[Tensor] = None
    route_checksums: Optional[Tensor] = None

    def __post_init__(self) -> None:
        ids = self.input_ids
        if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"TrainBatch.input_ids must be an int64 [B, L] tensor, got "
                             f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}")
        self.input_ids = ids.long()
        B, L = ids.shape
        for name in ("prompt_lengths", "response_lengths"):
            v = torch.as_tensor(getattr(self, name))
            if v.shape != (B,):
                raise ValueError(f"TrainBatch.{name} must be [B={B}], got shape {tuple(v.shape)}")
            setattr(self, name, v.long())
        if B and int(self.prompt_lengths.min()) < 1:
            raise ValueError("TrainBatch.prompt_lengths must be >= 1 (a response token needs at least one token "
                             "of context)")
        if B and int(self.response_lengths.min()) < 0:
            raise ValueError("TrainBatch.response_lengths must be >= 0")
        total = self.prompt_lengths + self.response_lengths
        if B and int(total.max()) > L:
            raise ValueError(f"TrainBatch: prompt_lengths + response_lengths reach {int(total.max())} > "
                             f"input_ids width L={L}")
        mask = self.response_mask
        if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.shape[0] != B:
            raise ValueError(f"TrainBatch.response_mask must be [B={B}, R], got {tuple(getattr(mask, 'shape', ()))}")
        R = mask.shape[1]
        if R < 1:
            raise ValueError("TrainBatch.response_mask needs at least one column (R >= 1)")
        if B and int(self.response_lengths.max()) > R:
            raise ValueError(f"TrainBatch.response_mask has R={R} columns but a response has "
                             f"{int(self.response_lengths.max())} tokens")
        # Positions past a response's end are padding whatever the caller wrote there.
        self.response_mask = mask.bool() & (torch.arange(R)[None, :] < self.response_lengths[:, None])
        for name in BATCH_TOKEN_FIELDS:
            v = getattr(self, name)
            if v is not None:
                if not isinstance(v, Tensor) or v.shape != (B, R):
                    raise ValueError(f"TrainBatch.{name} must be per-token [B={B}, R={R}] aligned with response_mask, "
                                     f"got {tuple(getattr(v, 'shape', ()))}")
                setattr(self, name, v.float() if v.dtype in (torch.float16, torch.bfloat16) else v)
        re = self.routed_experts
        if re is not None and (re.dim() != 4 or re.shape[:2] != (B, L)):
            raise ValueError(f"TrainBatch.routed_experts must be [B={B}, L={L}, num_moe_layers, topk], got "
                             f"{tuple(re.shape)}")
        if self.group_ids is not None and torch.as_tensor(self.group_ids).shape != (B,):
            raise ValueError(f"TrainBatch.group_ids must be [B={B}]")
        if self.route_checksums is not None and (re is None or torch.as_tensor(self.route_checksums).shape != (B,)):
            raise ValueError(f"TrainBatch.route_checksums must be [B={B}] and come with routed_experts")

    # ------------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_lengths(self) -> Tensor:
        return self.prompt_lengths + self.response_lengths

    def select(self, rows: Union[Sequence[int], Tensor]) -> "TrainBatch":
        """The sub-batch of the given rows (same widths L and R)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        kw = {f.name: (None if getattr(self, f.name) is None else getattr(self, f.name)[rows])
              for f in dataclasses.fields(self)}
        return TrainBatch(**kw)

    def split(self, parts: int) -> List["TrainBatch"]:
        """``parts`` contiguous equal shards (e.g. one per data-parallel rank)."""
        if parts < 1 or self.batch_size % parts:
            raise ValueError(f"cannot split a batch of {self.batch_size} sequences into {parts} equal parts")
        n = self.batch_size // parts
        return [self.select(range(i * n, (i + 1) * n)) for i in range(parts)]

    def replace(self, **fields) -> "TrainBatch":
        """A copy with some fields replaced (e.g. ``old_logprobs=forward_result.logprobs``)."""
        return dataclasses.replace(self, **fields)

    @classmethod
    def from_sequences(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *,
                       advantages: Optional[Sequence] = None, loss_masks: Optional[Sequence] = None,
                       rollout_logprobs: Optional[Sequence] = None, routed_experts: Optional[Sequence] = None,
                       group_ids: Optional[Sequence[int]] = None, policy_versions: Optional[Sequence] = None,
                       pad_id: int = 0) -> "TrainBatch":
        """Pad python/tensor sequences into a batch. ``advantages`` items may be a float (broadcast over the
        response) or per-token; ``routed_experts`` items are ``[P_i + R_i, num_moe_layers, topk]``."""
        B = len(prompts)
        if len(responses) != B:
            raise ValueError(f"{B} prompts but {len(responses)} responses")
        plens, rlens = [len(p) for p in prompts], [len(r) for r in responses]
        plen, rlen = torch.tensor(plens, dtype=torch.long), torch.tensor(rlens, dtype=torch.long)
        L, R = int((plen + rlen).max()) if B else 0, max(1, int(rlen.max()) if B else 1)
        # Each field is filled with one masked assignment from one flat list: a batch is thousands of sequences
        # at scale, and a tensor op per sequence cost the driver ~0.4 ms each (under the rollout threads' GIL).
        ids = torch.full((B, L), pad_id, dtype=torch.long)
        ids[torch.arange(L) < (plen + rlen)[:, None]] = torch.tensor(
            list(itertools.chain.from_iterable(x for p, r in zip(prompts, responses) for x in (_flat(p), _flat(r)))),
            dtype=torch.long)
        valid = torch.arange(R) < rlen[:, None]

        def per_token(values, fill, dtype):
            if values is None:
                return None
            out = torch.full((B, R), fill, dtype=dtype)
            def row(v, n):
                v = _flat(v)
                return v * n if len(v) == 1 and n != 1 else v[:n]  # a scalar is broadcast over the response
            out[valid] = torch.tensor(list(itertools.chain.from_iterable(map(row, values, rlens))), dtype=dtype)
            return out

        mask = torch.ones(B, R, dtype=torch.bool) if loss_masks is None else per_token(loss_masks, False, torch.bool)
        re = None
        if routed_experts is not None:
            first = torch.as_tensor(routed_experts[0])
            re = torch.zeros((B, L) + tuple(first.shape[1:]), dtype=torch.long)
            re[:] = torch.arange(first.shape[-1])  # padding: any valid, distinct expert ids
            for i, r in enumerate(routed_experts):
                r = torch.as_tensor(r, dtype=torch.long)
                re[i, : r.shape[0]] = r
        return cls(ids, plen, rlen, mask, advantages=per_token(advantages, 0.0, torch.float32),
                   rollout_logprobs=per_token(rollout_logprobs, 0.0, torch.float32), routed_experts=re,
                   group_ids=None if group_ids is None else torch.as_tensor(group_ids, dtype=torch.long),
                   policy_version=per_token(policy_versions, -1, torch.int64))
