"""The model part of the config, and HF config -> Megatron ``TransformerConfig``.

:class:`ModelConfig` is what a user writes (HF path, dtype, vocabulary padding, layer spec, MoE
dispatcher...). :class:`HFArch` is the validated architecture read from the HF ``config.json``: every
HF quirk is resolved here, once, so the builder and the weight mapping read plain fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from megatron_rl.config.sections import MODEL_DTYPES, ModelConfig, ParallelLayout
from megatron_rl.models import deepseek, glm, qwen3_next

# model_type -> (attention projections have a bias, q/k RMSNorm per head, MoE)
_FAMILIES: Dict[str, Tuple[bool, bool, bool]] = {
    "llama": (False, False, False),
    "qwen2": (True, False, False),
    "qwen3": (False, True, False),
    "qwen3_moe": (False, True, True),
    "mixtral": (False, False, True),
    "deepseek_v3": (False, False, True),  # MLA + shared expert + sigmoid router: models/deepseek.py
    "glm4_moe": (False, False, True),  # bias, q/k norm from the config; partial RoPE; DeepSeek's router: models/glm.py
}
SUPPORTED_MODEL_TYPES = tuple(_FAMILIES)
_DTYPES = {name: getattr(torch, name) for name in MODEL_DTYPES}


def torch_dtype(cfg: ModelConfig) -> torch.dtype:
    """The parameter dtype ``model.dtype`` names."""
    return _DTYPES[cfg.dtype]


@dataclass(frozen=True)
class HFArch:
    """The architecture of an HF causal LM, validated and with HF's naming differences resolved."""

    model_type: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int  # dense MLP width
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    llama3_rope_factor: Optional[float]  # None: plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    init_std: float
    # MoE (num_experts == 0 for dense models)
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: Tuple[bool, ...] = ()  # per layer: is it an MoE layer
    mla: Optional[deepseek.MLAArch] = None  # DeepSeek-V3-style: MLA, shared expert, sigmoid router
    glm: Optional[glm.GLMArch] = None  # GLM-4.5-style: shared expert, sigmoid router
    rotary_percent: float = 1.0  # the rotated fraction of each head (HF partial_rotary_factor)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def sigmoid_router(self):
        """DeepSeek-V3 / GLM-4.5's router fields (shared expert, groups, scaling, MTP); None for the others."""
        return self.mla if self.mla is not None else self.glm

    @classmethod
    def from_hf(cls, hf: Any) -> "HFArch":
        model_type = getattr(hf, "model_type", None)
        if model_type == qwen3_next.MODEL_TYPE:
            raise ValueError(qwen3_next.UNSUPPORTED)
        if model_type not in _FAMILIES:
            raise ValueError(
                f"unsupported HF model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        qkv_bias, qk_norm, is_moe = _FAMILIES[model_type]
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"{model_type}: hidden_act={hf.hidden_act!r} unsupported (only 'silu')")
        if getattr(hf, "attention_bias", False) and model_type != glm.MODEL_TYPE:  # GLM's: q/k/v bias
            raise ValueError(f"{model_type}: attention_bias=True (bias on o_proj) is not supported")
        if getattr(hf, "mlp_bias", False):
            raise ValueError(f"{model_type}: mlp_bias=True is not supported")
        if getattr(hf, "use_sliding_window", False) or (
            model_type == "mixtral" and getattr(hf, "sliding_window", None)
        ):
            raise ValueError(f"{model_type}: sliding-window attention is not supported")
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        moe: Dict[str, Any] = {}
        if model_type == deepseek.MODEL_TYPE:  # MLA has its own RoPE fields (arch.mla.rope)
            moe = deepseek.hf_fields(hf)
            head_dim = moe.pop("head_dim")
            rope_theta, llama3_factor = dict(moe["mla"].rope)["rotary_base"], None
        else:
            if model_type == glm.MODEL_TYPE:
                moe = glm.hf_fields(hf)
                qkv_bias, qk_norm = moe.pop("qkv_bias"), moe.pop("qk_norm")
            rope_theta, llama3_factor = _rope(hf)
        if is_moe and not moe:
            num_experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts")
            if model_type == "mixtral":
                layers = (True,) * hf.num_hidden_layers
                moe_ffn, norm_topk = hf.intermediate_size, True  # Mixtral always renormalises
            else:
                step, dense_only = getattr(hf, "decoder_sparse_step", 1), set(hf.mlp_only_layers or [])
                layers = tuple(
                    i not in dense_only and (i + 1) % step == 0 for i in range(hf.num_hidden_layers)
                )
                moe_ffn, norm_topk = hf.moe_intermediate_size, bool(hf.norm_topk_prob)
            moe = dict(
                num_experts=num_experts,
                moe_topk=hf.num_experts_per_tok,
                moe_ffn_hidden_size=moe_ffn,
                norm_topk_prob=norm_topk,
                moe_layers=layers,
            )
        return cls(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            ffn_hidden_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=moe.pop("num_kv_heads", None) or getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=rope_theta,
            llama3_rope_factor=llama3_factor,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            init_std=getattr(hf, "initializer_range", 0.02),
            **moe,
        )


def _rope(hf: Any) -> Tuple[float, Optional[float]]:
    """(theta, llama3 factor or None). transformers 5 keeps both in ``rope_parameters``; 4.x uses
    ``rope_theta`` + ``rope_scaling``."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    theta = float(params.get("rope_theta", 10000.0))
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        # Megatron's llama3 scaling hard-codes these three constants; refuse anything else.
        fixed = {"low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 8192}
        wrong = {k: params.get(k) for k, v in fixed.items() if params.get(k) != v}
        if wrong:
            raise ValueError(f"llama3 RoPE scaling with {wrong} unsupported; Megatron fixes {fixed}")
        return theta, float(params["factor"])
    raise ValueError(f"RoPE type {rope_type!r} unsupported; supported: 'default', 'llama3'")


def padded_vocab_size(vocab_size: int, divisor: int, tp: int) -> int:
    """Megatron's padding: the smallest multiple of ``divisor * tp`` that is >= ``vocab_size``."""
    multiple = divisor * tp
    return -(-vocab_size // multiple) * multiple


def check_divisibility(arch: HFArch, layout: ParallelLayout) -> None:
    """Fail early, naming the numbers, when the model cannot be split over ``layout``."""
    tp, pp, ep = layout.tp, layout.pp, layout.ep
    etp = tp if layout.etp is None else layout.etp
    checks = [("num_attention_heads", arch.num_heads, tp), ("num_hidden_layers", arch.num_layers, pp)]
    if not arch.is_moe or not all(arch.moe_layers):
        checks.append(("ffn hidden size (intermediate_size)", arch.ffn_hidden_size, tp))
    if arch.num_kv_heads >= tp:
        checks.append(("num_key_value_heads", arch.num_kv_heads, tp))
    elif tp % arch.num_kv_heads:
        raise ValueError(
            f"TP={tp} must be a multiple of num_key_value_heads={arch.num_kv_heads} when it exceeds it"
        )
    else:  # ranks then split the fused q/k/v rows of a KV group
        checks.append(("fused qkv rows (heads + 2 * kv_heads) * head_dim",
                       (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim, tp))
    if arch.sigmoid_router is not None:
        checks += deepseek.divisibility_checks(arch, tp)
    if arch.is_moe:
        checks += [("num_experts", arch.num_experts, ep), ("moe ffn hidden size", arch.moe_ffn_hidden_size, etp)]
    elif ep > 1:
        raise ValueError(f"expert parallel size ep={ep} given for the dense model type {arch.model_type!r}")
    for what, n, parts in checks:
        if n % parts:
            raise ValueError(f"{what}={n} is not divisible by the parallel size {parts}")


def transformer_config(cfg: ModelConfig, arch: HFArch, layout: ParallelLayout, *, initialize: bool = True):
    """The Megatron ``TransformerConfig`` for ``arch`` split over ``layout`` (CPU-safe settings).

    ``initialize=False`` skips Megatron's random initialisation (weights are loaded afterwards).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_divisibility(arch, layout)
    sp = layout.tp > 1 if cfg.sequence_parallel is None else cfg.sequence_parallel
    if arch.is_moe and layout.tp > 1 and not sp:
        raise ValueError("MoE with TP > 1 requires sequence parallelism; set model.sequence_parallel")
    dtype = torch_dtype(cfg)
    kwargs: Dict[str, Any] = dict(
        # parallelism
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,  # None: same as TP
        context_parallel_size=layout.cp,
        sequence_parallel=sp,
        params_dtype=dtype,
        pipeline_dtype=dtype,  # mandatory with PP
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=initialize,
        # architecture
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        qk_layernorm=arch.qk_norm,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.init_std,
        # every fusion off: they need CUDA kernels (and are numerically different from HF)
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,  # models.spec.use_fused_wgrad turns it on (ours in torch, not Apex's)
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
    )
    if arch.is_moe:
        kwargs.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_topk,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            moe_layer_freq=[int(m) for m in arch.moe_layers],
            # softmax over all experts then top-k (HF norm_topk_prob=False) vs top-k then softmax over
            # the k, which equals HF's renormalised top-k probabilities (norm_topk_prob=True).
            moe_router_pre_softmax=not arch.norm_topk_prob,
            moe_router_score_function="softmax",
            moe_router_dtype="fp32",  # HF routes in float32 too
            moe_router_load_balancing_type="aux_loss" if cfg.moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
            moe_token_dispatcher_type=cfg.moe_dispatcher,
            moe_grouped_gemm=cfg.moe_grouped_gemm,
            moe_permute_fusion=False,
            moe_enable_routing_replay=cfg.routing_replay,
        )
    config_cls = TransformerConfig
    if arch.mla is not None:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config_cls = MLATransformerConfig
        kwargs.update(deepseek.transformer_kwargs(arch))
    if arch.glm is not None:
        kwargs.update(glm.transformer_kwargs(arch))
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(cfg.transformer_overrides) - known)
    if unknown:
        raise ValueError(f"model.transformer_overrides has unknown TransformerConfig fields: {unknown}")
    kwargs.update(cfg.transformer_overrides)
    return config_cls(**kwargs)
