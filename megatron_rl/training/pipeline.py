"""Run micro-batches through Megatron's pipeline schedules (``get_forward_backward_func``).

One function, :func:`run_micro_batches`, used by every pass of the trainer (train step, forward-only
log-probs, reference logits). The caller's ``loss_fn(logits, micro_batch, index)`` runs on the last
pipeline stage and returns ``(loss, payload)``; payloads come back in micro-batch order on the last
stage (an empty list elsewhere).

Megatron's schedule treats the loss like this (``forward_step_calc_loss``, two-value loss functions):
``loss * cp_size / num_microbatches`` is back-propagated, and DDP then multiplies the summed gradient
by ``1 / (dp * cp)``. The train step compensates with its own factor (see
:mod:`megatron_rl.training.trainer`); this module does not scale anything.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_rl.parallel import device
from megatron_rl.training.batch import MicroBatch

Tensor = torch.Tensor
LossFn = Callable[[Tensor, MicroBatch, int], Tuple[Tensor, Any]]


def run_micro_batches(model, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, *, forward_only: bool,
                      before_forward: Optional[Callable[[MicroBatch], None]] = None,
                      on_micro_batch: Optional[Callable[[int], None]] = None) -> List[Any]:
    """Forward (and unless ``forward_only`` backward) every micro-batch through ``model``'s pipeline.

    ``model`` is this rank's stage (a GPTModel or its DDP wrapper). ``before_forward(mb)`` runs on every
    stage right before each micro-batch's forward (e.g. to set the routing-replay ids).
    ``on_micro_batch(done)`` runs on the last stage once each micro-batch's loss is computed (progress).
    Gradients accumulate into the DDP buffers; ``finalize_model_grads`` (set on the model config) runs
    once at the end of a backward schedule.
    """
    items = iter(enumerate(micro_batches))

    def forward_step(data_iterator, stage):
        k, mb = next(data_iterator)
        if before_forward is not None:
            before_forward(mb)
        # causal: right padding is harmless; packed streams carry their boundaries
        out = stage(mb.input_ids, mb.position_ids, attention_mask=None, packed_seq_params=packed_seq_params(mb))

        def loss_func(logits: Tensor):
            loss, payload = loss_fn(logits, mb, k)
            if on_micro_batch is not None:
                on_micro_batch(k + 1)
            # The schedule divides the returned loss in place: never hand it a tensor the payload shares.
            return loss.clone() if forward_only else loss, payload

        return out, loss_func

    longest = max(mb.seq_length for mb in micro_batches)  # before the CP split: Megatron divides by CP
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=items,
        model=[model],
        num_microbatches=len(micro_batches),
        # Used for the p2p buffers only when all micro-batches share one length (fixed-shape pipelines);
        # with variable_seq_lengths the stages exchange each micro-batch's shape.
        seq_length=longest,
        micro_batch_size=micro_batches[0].size,
        forward_only=forward_only,
    )


def packed_seq_params(mb: MicroBatch):
    """Megatron's THD parameters of a packed micro-batch (None when padded). Boundaries in full-stream
    coordinates: real lengths in ``cu_seqlens_*``, the (CP-padded) segments in ``cu_seqlens_*_padded``,
    which Megatron's RoPE and our core attention read and Transformer Engine uses to skip the padding."""
    if not mb.packed:
        return None

    dev = device()
    cu, cu_padded = mb.cu_seqlens.to(dev), mb.cu_seqlens_padded.to(dev)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                           cu_seqlens_kv_padded=cu_padded, max_seqlen_q=mb.max_seqlen, max_seqlen_kv=mb.max_seqlen)
