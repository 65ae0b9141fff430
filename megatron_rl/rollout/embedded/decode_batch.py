"""The embedded engine's running batch: rows decoded together over one left-padded KV cache, joining and
leaving between decode steps (continuous batching, as SGLang's scheduler does).

Rows join after their own prefill: the new rows' cache and the batch's are left-padded to one length and
concatenated (masked positions add exact zeros to attention, so where a row sits in the batch only moves float
rounding). Finished rows leave at once and columns no row needs any more are trimmed from the left, so a long
straggler decodes alone over its own context, not over the batch it started with. Joining needs plain
``DynamicLayer`` caches (every model we serve); for another cache type rows join only an empty batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch
from transformers.cache_utils import DynamicLayer

from megatron_rl.rollout.client.protocol import GenerateRequest, Sample
from megatron_rl.rollout.client.weight_versions import WeightVersionEvent, WeightVersionSpan
from megatron_rl.rollout.embedded.sampling import RowParams


@dataclass
class Row:
    """One sequence being sampled: request ``req``'s sample number ``index``."""

    req: GenerateRequest
    index: int
    seed: int
    rid: str
    tokens: List[int]
    logprobs: List[float]
    top_ids: List[torch.Tensor]
    top_values: List[torch.Tensor]
    finish: Optional[str] = None
    matched: Optional[int] = None
    processed: Optional[List[float]] = None  # "processed" log-probs, when the request asked for them
    abort_message: Optional[str] = None
    version_events: List[WeightVersionEvent] = field(default_factory=list)  # weight_versions.py
    # set when the row joins a batch
    generator: Optional[torch.Generator] = None
    limit: int = 0  # response tokens allowed (max_new_tokens, or what the context leaves)
    epoch: int = 0  # the engine's abort epoch at joining: an abort_all after it ends the row
    n_prompt: int = 0
    prompt_routes: Optional[torch.Tensor] = None  # [n_prompt, MoE layers, topk] of the prefill
    routes: List[torch.Tensor] = field(default_factory=list)  # [MoE layers, topk] of the forward feeding token t

    def to_sample(self, spans: List[WeightVersionSpan], logprob_mode: str, finish: Optional[str] = None) -> Sample:
        """The answer for this row; ``spans`` say which weight version produced which of its tokens."""
        top_ids = torch.stack(self.top_ids) if self.top_ids else None
        top_values = torch.stack(self.top_values) if self.top_values else None
        routed = prompt_routed = None
        if self.req.return_routed_experts and self.prompt_routes is not None:
            prompt_routed = self.prompt_routes  # [P_b, L, K]
            R, (L, K) = len(self.tokens), self.prompt_routes.shape[1:]
            routed = torch.full((R, L, K), -1, dtype=torch.int32)
            # response token t is fed (and routed) by the t-th decode forward; tokens never fed stay -1
            for t, layers in enumerate(self.routes[:R]):
                routed[t] = layers
        return Sample(
            prompt_ids=list(self.req.prompt_ids), response_ids=self.tokens, logprobs=self.logprobs,
            finish_reason=finish or self.finish or "abort", matched_stop=self.matched, top_logprob_ids=top_ids,
            top_logprob_values=top_values, routed_experts=routed, prompt_routed_experts=prompt_routed,
            weight_version=spans[-1].version, logprob_mode=logprob_mode, rid=self.rid, sample_index=self.index,
            sampling_logprobs=self.processed, abort_message=self.abort_message, weight_versions=spans,
        )


def _dynamic_layers(cache: Any) -> Optional[list]:
    layers = getattr(cache, "layers", None)
    if layers and all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers):
        return layers
    return None


def _pad_left(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return x
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([x.new_zeros(shape), x], dim=dim)


class DecodeBatch:
    """``rows`` with their ``mask [B, L]``, last fed positions ``pos [B, 1]``, KV ``cache`` and next-token
    ``logits [B, V]`` (and ``tokens [B]`` sampled from them, until fed); :meth:`join` adds prefilled rows,
    :meth:`keep` drops rows, :meth:`decode_inputs` feeds the tokens."""

    def __init__(self) -> None:
        self.rows: List[Row] = []
        self.mask = self.pos = self.logits = None
        self.tokens: Optional[torch.Tensor] = None  # [B] sampled, not yet fed
        self.cache: Any = None
        self.params: Optional[RowParams] = None

    def __len__(self) -> int:
        return len(self.rows)

    def can_join(self) -> bool:
        return not self.rows or _dynamic_layers(self.cache) is not None

    def join(self, rows: List[Row], mask: torch.Tensor, pos: torch.Tensor, cache: Any, logits: torch.Tensor) -> None:
        """Add prefilled ``rows`` (their left-padded ``mask [n, P]``, ``pos [n, P]``, cache and last logits)."""
        if not self.rows:
            self.rows, self.mask, self.pos, self.cache, self.logits = list(rows), mask, pos[:, -1:], cache, logits
        else:
            mine, theirs = _dynamic_layers(self.cache), _dynamic_layers(cache)
            if mine is None or theirs is None:
                raise RuntimeError("rows can join a running batch only over DynamicLayer caches (can_join())")
            L = max(self.mask.shape[1], mask.shape[1])
            da, db = L - self.mask.shape[1], L - mask.shape[1]
            for a, b in zip(mine, theirs):
                a.keys = torch.cat([_pad_left(a.keys, da, -2), _pad_left(b.keys, db, -2)], dim=0)
                a.values = torch.cat([_pad_left(a.values, da, -2), _pad_left(b.values, db, -2)], dim=0)
            self.mask = torch.cat([_pad_left(self.mask, da, 1), _pad_left(mask, db, 1)], dim=0)
            self.pos = torch.cat([self.pos, pos[:, -1:]], dim=0)
            self.logits = torch.cat([self.logits, logits], dim=0)
            self.rows.extend(rows)
        self.params = RowParams.from_params([r.req.sampling for r in self.rows], device=self.logits.device)

    def keep(self, keep: List[bool]) -> None:
        """Drop the rows marked False; trim the columns no remaining row attends to."""
        if all(keep):
            return
        self.rows = [r for r, k in zip(self.rows, keep) if k]
        if not self.rows:
            self.__init__()
            return
        index = torch.tensor([i for i, k in enumerate(keep) if k], device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask, self.pos, self.logits = self.mask[index], self.pos[index], self.logits[index]
        if self.tokens is not None:
            self.tokens = self.tokens[index]
        first = int(self.mask.any(0).int().argmax())  # the first column a row still attends to
        layers = _dynamic_layers(self.cache)
        if first > 0 and layers is not None:
            self.mask = self.mask[:, first:]
            for layer in layers:
                layer.keys, layer.values = layer.keys[..., first:, :], layer.values[..., first:, :]
        self.params = RowParams.from_params([r.req.sampling for r in self.rows], device=self.logits.device)

    def decode_inputs(self):
        """``(ids [B, 1], mask [B, L + 1], pos [B, 1])`` to feed the sampled ``tokens``."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], dim=1)
        self.pos = self.pos + 1
        ids, self.tokens = self.tokens.unsqueeze(1).to(self.mask.device), None
        return ids, self.mask, self.pos

    @property
    def generators(self) -> List[torch.Generator]:
        return [r.generator for r in self.rows]

    @property
    def top_n(self) -> int:
        return max(r.req.return_top_logprobs for r in self.rows)

    @property
    def wants_routes(self) -> bool:
        return any(r.req.return_routed_experts for r in self.rows)
