"""The fused output layer in the trainer (``train.fused_head``): the last stage hands the loss the
output layer's input instead of its logits.

Megatron's ``GPTModel`` ends with ``output_layer`` (a ``ColumnParallelLinear``: the input region op,
then ``hidden @ W_local^T``). Inside :func:`hidden_states_out` that layer returns its input after the
same region op instead: the all-gather over sequence parallelism (backward: reduce-scatter), or the
identity whose backward all-reduces over TP (:class:`_SumGradOverTP`). The model's output is then
``[b, s, H]`` and the loss
computes every statistic with :func:`megatron_rl.ops.vocab_parallel_linear_stats` /
:func:`~megatron_rl.ops.vocab_parallel_linear_kl` from it and :func:`output_weight` (the embedding under
tied embeddings, also on the last pipeline stage's copy). Gradients reach ``W`` through autograd, so
Megatron DDP's hooks and the tied-embedding all-reduce see them as usual.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from megatron_rl.ops import (
    VocabStats, vocab_parallel_kl, vocab_parallel_linear_kl, vocab_parallel_linear_stats, vocab_parallel_stats,
)

Tensor = torch.Tensor


def check_supported(module) -> None:
    """Refuse models whose output layer does more than ``hidden @ W^T`` (clear error, at build)."""
    if getattr(module.config, "mtp_num_layers", None):
        raise ValueError("train.fused_head=true does not support multi-token prediction (mtp_num_layers); "
                         "set train.fused_head=false")
    layer = getattr(module, "output_layer", None)
    if layer is not None and getattr(layer, "bias", None) is not None:
        raise ValueError("train.fused_head=true needs an output layer without bias; set train.fused_head=false")


def output_weight(module) -> Tensor:
    """This rank's ``[V_local, H]`` output weight (last stage): the word embedding under tied embeddings
    on a single stage, the last stage's tied copy with PP, else the output layer's own weight."""
    if module.share_embeddings_and_output_weights:
        return module.shared_embedding_or_output_weight()
    return module.output_layer.weight


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the TP group (each rank's gradient is
    its vocabulary shard's part). Megatron's ``copy_to_tensor_model_parallel_region`` would do the same
    but all-reduces ``grad.contiguous()`` and returns the original: the reduction is lost for the
    transposed (non-contiguous) gradient that ``GPTModel``'s ``[s, b] -> [b, s]`` output hands back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _emit_input(layer, input_, weight=None, runtime_gather_output=None):
    if layer.sequence_parallel:
        return gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True,
                                                    group=layer.tp_group), None
    if layer.allreduce_dgrad:
        return _SumGradOverTP.apply(input_, layer.tp_group), None
    return input_, None


@contextlib.contextmanager
def hidden_states_out(module, enabled: bool = True):
    """While active, ``module`` (a last-stage GPTModel) returns the output layer's input ``[b, s, H]``."""
    layer = getattr(module, "output_layer", None) if enabled and module.post_process else None
    if layer is None:
        yield
        return
    layer.forward = lambda *a, **k: _emit_input(layer, *a, **k)  # shadows the class's forward
    try:
        yield
    finally:
        del layer.forward


@dataclass
class Head:
    """The last stage's output of one micro-batch: logits ``[b, s, V_local]``, or with ``weight`` the
    output layer's input ``[b, s, H]`` and its ``[V_local, H]`` weight."""

    x: Tensor
    weight: Optional[Tensor] = None

    @property
    def fused(self) -> bool:
        return self.weight is not None

    def _hidden(self) -> Tensor:
        return self.x if self.x.dtype == self.weight.dtype else self.x.to(self.weight.dtype)

    def rows(self, index: Tensor) -> "Head":
        """The rows ``x[b, s, *]`` at flat positions ``index`` (any shape) into ``b * s`` (``MicroBatch.logit_index``)."""
        return Head(self.x.reshape(-1, self.x.shape[-1])[index], self.weight)

    def stats(self, targets: Tensor, **kw) -> VocabStats:
        if self.fused:
            return vocab_parallel_linear_stats(self._hidden(), self.weight, targets, **kw)
        return vocab_parallel_stats(self.x, targets, **kw)

    def kl(self, ref: "Head", **kw) -> Tensor:
        if self.fused:
            return vocab_parallel_linear_kl(self._hidden(), self.weight, ref._hidden(), ref.weight, **kw)
        return vocab_parallel_kl(self.x, ref.x, **kw)

    def logits(self) -> Tensor:
        """The logits themselves (materialised with the fused head: only for DVP rules other than min-p,
        whose threshold search needs them)."""
        return torch.matmul(self._hidden(), self.weight.t()) if self.fused else self.x
