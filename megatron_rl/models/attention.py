"""The portable core attention: torch SDPA over padded ``[s, b]`` or packed (THD) input, with context
parallelism by all-gathering K/V over the CP group.

Megatron hands the core attention query ``[sq, b, np, hn]`` and key/value ``[sk, b, ng, hn]`` (``ng``
query groups on this TP rank, GQA when ``ng < np``), or, for packed sequences (``packed_seq_params``
with ``qkv_format='thd'``), ``[t, np, hn]`` with the sequences back to back and their boundaries in
``cu_seqlens``. Output ``[sq, b, np * hn]`` (packed: ``[t, np * hn]``).

* Padded: causal SDPA (right padding is harmless under a causal mask) or Megatron's boolean mask
  (``True`` = masked out).
* Packed (``cu_seqlens_*_padded`` when given: the segments the stream is cut into), attention never
  crossing a boundary: on CUDA one call per layer whatever the number of sequences (varlen flash
  attention; one padded causal SDPA under CP, in float32 or with dropout), on CPU one SDPA per distinct
  length (:mod:`megatron_rl.models.packed_attention`; ``PACKED_IMPL`` overrides the choice by device, e.g.
  the ``O(T²)`` block-diagonal mask in ``tools/bench_train.py``).
* Context parallelism (CP > 1): the local tokens are Megatron's zigzag chunks (chunks ``r`` and
  ``2·CP−1−r`` of ``2·CP``: of the padded sequence axis, or of each packed sequence). K/V are
  all-gathered over the CP group (its backward sums the K/V gradients of every rank's queries and
  keeps this rank's part), put back in sequence order, and each local query attends to the keys at or
  before its global position. Memory for K/V grows to the full sequence; the scores stay local.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from megatron_rl.models import packed_attention as packed
from megatron_rl.objectives.reduce import zigzag_split

PACKED_IMPL = "auto"  # by device (packed_attention.choose_impl); or "padded", "varlen", "block_diagonal"


class SDPACoreAttention(MegatronModule):
    """Core attention with torch SDPA: padded or packed input, context parallelism over ``pg_collection.cp``."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ) -> None:
        super().__init__(config=config)

        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise ValueError("SDPACoreAttention supports vanilla softmax without sliding window only")
        self.causal = attn_mask_type == AttnMaskType.causal
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
            self.cp_group = pg_collection.cp
        else:
            from megatron.core import parallel_state

            self.cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
        self.cp = self.cp_group.size() if self.cp_group is not None else 1
        if self.cp > 1 and not self.causal:
            raise ValueError("SDPACoreAttention: context parallelism needs causal self-attention")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention: attention bias needs the TE spec")
        dropout = self.dropout if self.training else 0.0
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            if attention_mask is not None:
                raise NotImplementedError("SDPACoreAttention: packed sequences take no attention mask")
            return self._packed(query, key, value, packed_seq_params, dropout)
        sq, b, np_, hn = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        mask, causal = None, False
        if self.cp > 1:
            if attention_mask is not None:
                raise NotImplementedError("SDPACoreAttention: context parallelism with an attention mask")
            kv = gather_from_cp(torch.cat([k, v], dim=-1), self.cp_group, dim=2)  # rank order
            k, v = kv.split(hn, dim=-1)
            local = zigzag_positions(sq * self.cp, self.cp, self.cp_group.rank(), query.device)
            every = zigzag_positions(sq * self.cp, self.cp, None, query.device)
            mask = every[None, :] <= local[:, None]
        elif attention_mask is not None:
            mask = ~attention_mask  # SDPA: True = attend
        elif self.causal:
            if key.shape[0] != sq:
                raise NotImplementedError("causal SDPA without a mask needs equal query/key lengths")
            causal = True
        out = _sdpa(q, k, v, mask, causal, dropout, self.scale, self.config.sequence_parallel)
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)

    def _packed(self, query, key, value, params, dropout) -> torch.Tensor:
        t, np_, hn = query.shape
        rank = self.cp_group.rank() if self.cp > 1 else 0
        plan = packed.plan_for(params, self.cp, rank, query.device)
        k, v = key, value
        if self.cp > 1:  # [T, groups, hn] in rank order; the plan's indices map stream rows into it
            kv = gather_from_cp(torch.cat([key, value], dim=-1), self.cp_group, dim=0)
            k, v = kv.split(hn, dim=-1)
        impl = packed.choose_impl(PACKED_IMPL, query, self.cp, dropout)
        sp = self.config.sequence_parallel

        def sdpa(q, k, v, mask, causal, p):
            return _sdpa(q, k, v, mask, causal, p, self.scale, sp)

        out = packed.packed_attention(impl, query, k, v, plan, self.scale, dropout, sdpa)
        return out.reshape(t, np_ * hn)


def _sdpa(q, k, v, mask, causal, dropout, scale, sequence_parallel):
    gqa = q.shape[1] != k.shape[1]
    if dropout > 0.0 and not sequence_parallel:
        # Heads differ across TP ranks: draw dropout from the TP-rank-specific RNG stream (as Megatron).
        from megatron.core import tensor_parallel

        with tensor_parallel.get_cuda_rng_tracker().fork():
            return F.scaled_dot_product_attention(
                q, k, v, mask, dropout, is_causal=causal, scale=scale, enable_gqa=gqa
            )
    return F.scaled_dot_product_attention(q, k, v, mask, dropout, is_causal=causal, scale=scale, enable_gqa=gqa)


# ---------------------------------------------------------------------------------------------------
# Zigzag layout and the CP all-gather
# ---------------------------------------------------------------------------------------------------


def zigzag_positions(n: int, cp: int, rank: Optional[int], device=None) -> torch.Tensor:
    """Positions ``[0, n)`` that CP rank ``rank`` holds (chunks ``rank`` and ``2·cp−1−rank`` of ``2·cp``);
    ``rank=None``: every rank's, concatenated in rank order (the order of an all-gather)."""
    every = torch.arange(n, device=device)
    return torch.cat([zigzag_split(every, cp, r) for r in (range(cp) if rank is None else (rank,))])


class _GatherFromCP(torch.autograd.Function):
    """All-gather along ``dim`` over the CP group (rank order); backward: the gradient summed over the
    group, this rank's slice (a reduce-scatter, written as all-reduce + slice: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.n = group, dim, x.shape[dim]
        parts = [torch.empty_like(x) for _ in range(group.size())]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank = ctx.group.rank()
        return grad.narrow(ctx.dim, rank * ctx.n, ctx.n), None, None


def gather_from_cp(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    return _GatherFromCP.apply(x, group, dim)
