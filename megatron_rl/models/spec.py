"""Transformer layer specs: Transformer Engine on GPU, a portable torch spec everywhere else.

The portable ("local") spec uses Megatron's own tensor-parallel linears, attention block, MLP and
MoE layer, and swaps in two small modules of ours:

* :class:`~megatron_rl.models.attention.SDPACoreAttention` — ``torch.nn.functional.scaled_dot_product_attention``
  with GQA, packed sequences and context parallelism. Megatron's stock ``DotProductAttention`` builds its
  causal mask with CUDA tensors, and SDPA is both faster on CPU and closer to HF's numerics.
* :class:`RMSNorm` — computes in float32 like HF's ``*RMSNorm`` and, unlike Megatron's
  ``WrappedTorchNorm``, supports sequence parallelism (its weight carries the ``sequence_parallel``
  attribute so ``finalize_model_grads`` all-reduces its gradient over TP).

With ``model.fused_elementwise`` on (default with CUDA) the norms, SwiGLU, RoPE and residual adds are
``torch.compile``'d (:mod:`megatron_rl.models.fused_layer`): same modules, parameters and checkpoint keys.
"""

from __future__ import annotations

import importlib.util
from typing import List

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import (
    TransformerLayer, TransformerLayerSubmodules, get_transformer_layer_offset,
)

from megatron_rl.models import deepseek, fused_layer, fused_wgrad
from megatron_rl.models.attention import SDPACoreAttention
from megatron_rl.models.config import ModelConfig


class RMSNorm(torch.nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` computed in float32, cast back before the weight (HF order)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused) -> None:
        super().__init__()
        self.eps = eps
        # Megatron's layernorm_zero_centered_gamma (Qwen3-Next's norms): the weight holds w - 1
        self.zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        # Replicated over TP but fed sequence shards: its grad must be summed over TP.
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def scale(self) -> torch.Tensor:
        return self.weight + 1 if self.zero_centered else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_layer.rms_norm(x, self.scale(), self.eps)


class FusedRMSNorm(RMSNorm):
    """:class:`RMSNorm` (same parameters and checkpoint keys) as one compiled call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_layer.compiled(fused_layer.rms_norm)(x, self.scale(), self.eps)


def fused_on(cfg: ModelConfig) -> bool:
    """``model.fused_elementwise`` resolved for this process's device, on the local spec only."""
    return resolve_layer_spec(cfg.layer_spec) == "local" and fused_layer.resolve(cfg.fused_elementwise,
                                                                                torch.cuda.is_available())


def use_fused_wgrad(cfg: ModelConfig) -> bool:
    """With the fused layer, weight gradients accumulate into DDP's fp32 ``main_grad`` inside the wgrad GEMM
    (Megatron's ``gradient_accumulation_fusion``, :mod:`megatron_rl.models.fused_wgrad`): installed here."""
    on = fused_on(cfg)
    if on:
        fused_wgrad.install()
    return on


def resolve_layer_spec(choice: str) -> str:
    """``"te"`` or ``"local"``; ``"auto"`` picks TE only when it is importable and CUDA is present."""
    te_ok = importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available()
    if choice == "auto":
        return "te" if te_ok else "local"
    if choice == "te" and not te_ok:
        raise ValueError(
            "model.layer_spec='te' needs transformer_engine (pip install 'megatron_rl[gpu]') and a CUDA "
            "device; on CPU use layer_spec='local' (or 'auto')"
        )
    return choice


def _local_layer_spec(num_experts: int, qk_norm: bool, fused: bool = False):
    """One layer: dense MLP when ``num_experts == 0``, else Megatron's MoE layer (SequentialMLP);
    ``fused``: norms, SwiGLU and residual adds compiled (:mod:`megatron_rl.models.fused_layer`)."""
    norm, mlp_cls, bda = RMSNorm, MLP, get_bias_dropout_add
    if fused:
        norm, mlp_cls, bda = FusedRMSNorm, fused_layer.FusedMLP, fused_layer.fused_bias_dropout_add
    moe = num_experts > 0
    if moe:
        mlp = get_moe_module_spec_for_backend(LocalSpecProvider(), num_experts=num_experts, moe_grouped_gemm=False)
    else:
        mlp = ModuleSpec(
            module=mlp_cls, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        )
    # Same checkpoint keys as the TE spec, where these norms are fused into the next linear.
    keys_map = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    if not moe:
        keys_map["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=SDPACoreAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=norm if qk_norm else IdentityOp,
                    k_layernorm=norm if qk_norm else IdentityOp,
                ),
            ),
            self_attn_bda=bda,
            pre_mlp_layernorm=norm,
            mlp=mlp,
            mlp_bda=bda,
            sharded_state_dict_keys_map=keys_map,
        ),
    )


def decoder_block_spec(cfg: ModelConfig, tconfig, pp_rank: int):
    """The ``TransformerBlockSubmodules`` for the layers pipeline stage ``pp_rank`` builds."""
    kind = resolve_layer_spec(cfg.layer_spec)
    if kind == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(
            tconfig, use_transformer_engine=True, normalization="RMSNorm", pp_rank=pp_rank
        )

    if tconfig.moe_grouped_gemm:
        raise ValueError("model.moe_grouped_gemm needs the TE layer spec (the local spec runs experts one by one)")
    experts = tconfig.num_moe_experts or 0
    pattern = tconfig.moe_layer_freq if experts else [0] * tconfig.num_layers
    fused = fused_on(cfg)
    fused_layer.install_rope(fused)  # RoPE is applied inside Megatron's attention: process-wide
    norm = FusedRMSNorm if fused else RMSNorm
    if getattr(tconfig, "multi_latent_attention", False):  # DeepSeek-V3-style layers
        moe, dense = (_local_layer_spec(n, False, fused).submodules.mlp for n in (experts, 0))
        q_lora = tconfig.q_lora_rank is not None
        specs: List = [deepseek.local_layer_spec(moe, dense, norm, bool(m), q_lora) for m in pattern]
    else:
        specs = [_local_layer_spec(experts if is_moe else 0, tconfig.qk_layernorm, fused) for is_moe in pattern]
    offset = get_transformer_layer_offset(tconfig, pp_rank=pp_rank)
    count = get_num_layers_to_build(tconfig, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=specs[offset : offset + count], layer_norm=norm)
