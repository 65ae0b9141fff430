"""CPU patches that only megatron-core >= 0.17 needs (the tested range's upper end is 0.19.2).

Registered into the registry when :mod:`megatron_rl.compat` is imported, applied by
:func:`megatron_rl.compat.apply` like the others (after them, CPU only). Each one is a no-op on
0.16.1, where the code it works around does not exist.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from megatron_rl.compat.registry import _during, _patch, _swapped


class _NoStream:
    """``torch.cuda.current_stream()`` on CPU: every wait is a no-op (CPU collectives are synchronous)."""

    def wait_event(self, event) -> None:
        return None

    def wait_stream(self, stream) -> None:
        return None


def _current_stream_is_noop() -> contextlib.AbstractContextManager:
    return _swapped(torch.cuda, "current_stream", lambda device=None: _NoStream())


@_patch(
    reason="the DDP bucket group's start_grad_sync calls torch.cuda.current_stream() unconditionally to wait "
    "for CUDA-graph wgrad events (megatron-core >= 0.17)",
    remove_when="start_grad_sync only asks for the stream when a parameter carries a CUDA-graph event",
)
def _grad_sync_without_cuda_stream() -> None:
    from megatron.core.distributed import param_and_grad_buffer

    _during(param_and_grad_buffer._ParamAndGradBucketGroup, "start_grad_sync", _current_stream_is_noop)


@_patch(
    reason="without Transformer Engine, multi_latent_attention binds its name Linear (modelopt's replicated "
    "linear) to None (megatron-core >= 0.17), so MLASelfAttention refuses the portable spec's replicated "
    "q/kv down projections (ValueError: Unsupported linear_q_down_proj)",
    remove_when="MLASelfAttention accepts modelopt's Linear without Transformer Engine",
)
def _mla_accepts_replicated_linear() -> None:
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer import multi_latent_attention

    if multi_latent_attention.Linear is None:
        multi_latent_attention.Linear = Linear


@_patch(
    reason="megatron-core >= 0.19 builds MLA's query projection without q-LoRA (q_lora_rank None) under "
    "qk_layernorm as the backend's fused norm+linear, which the local (no-TE) backend lacks (RuntimeError: "
    "qk_layernorm requires TransformerEngine); without q-LoRA there is no query norm to fuse, so the spec's "
    "own linear is used, as 0.16.1 did",
    remove_when="QKNormConfigResolver keeps a non-fused linear_q_proj when no query norm exists",
)
def _mla_query_projection_without_fused_norm() -> None:
    try:
        from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver
    except ImportError:  # megatron-core < 0.19: the spec's linear_q_proj is used as given
        return
    original = QKNormConfigResolver._mla_fused_linear_or_default
    if getattr(original, "_megatron_rl_compat", False):
        return

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    @functools.wraps(original)
    def _mla_fused_linear_or_default(self, module_spec, module_name):
        # only the portable spec's plain linear: the TE spec's (TEColumnParallelLinear) keeps upstream's choice
        if module_name == "linear_q_proj" and module_spec is ColumnParallelLinear:
            return module_spec
        return original(self, module_spec, module_name)

    _mla_fused_linear_or_default._megatron_rl_compat = True
    QKNormConfigResolver._mla_fused_linear_or_default = _mla_fused_linear_or_default
