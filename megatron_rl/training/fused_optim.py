"""Multi-tensor optimizer helpers for runs without Transformer Engine or Apex.

Megatron-Core falls back to ``megatron.core.utils.local_multi_tensor_l2_norm`` / ``_scale`` when neither
is installed (every machine this project is tested on): a Python loop over the gradients with a host sync
per tensor (``torch.tensor`` of a list of norms) and a CUDA tensor created even on CPU. The replacements
below use torch's ``_foreach`` kernels: one dispatch for all tensors, no host sync (the norm stays on the
tensors' device). torch's AdamW is told to take its ``foreach`` path as well (the CPU default is one
parameter at a time). With Transformer Engine or Apex nothing is changed.
"""

from __future__ import annotations

import importlib

import torch


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for ``amp_C.multi_tensor_l2norm``: ``(norm [1] float32, None)``."""
    tensors = [t for lst in tensor_lists for t in lst]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32), None
    norms = torch._foreach_norm(tensors, 2.0)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]) if len(norms) > 1 else norms[0].float())
    return total.reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for ``amp_C.multi_tensor_scale``: ``dst = src * scale`` for every pair."""
    src, dst = list(tensor_lists[0]), list(tensor_lists[1])
    if not src:
        return
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def install(optimizer=None) -> None:
    """Swap Megatron's local fallbacks for the ``_foreach`` versions (idempotent); with ``optimizer``, put
    its torch Adam(W) groups on the ``foreach`` path."""
    from megatron.core import utils

    for name in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        module = importlib.import_module(name)
        if getattr(module, "l2_norm_impl", None) is utils.local_multi_tensor_l2_norm:
            module.l2_norm_impl = foreach_l2_norm
        if getattr(module, "multi_tensor_scale_impl", None) is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale
    if optimizer is None:
        return
    for leaf in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(leaf, "optimizer", None)
        if isinstance(inner, torch.optim.AdamW) or type(inner) is torch.optim.Adam:
            for group in inner.param_groups:
                if not group.get("fused"):
                    group["foreach"] = True
