"""GLM-4.5-style MoE models (HF ``model_type="glm4_moe"``, ``Glm4MoeForCausalLM``): what differs from the
GQA families and from DeepSeek-V3 (:mod:`megatron_rl.models.deepseek`).

Read from transformers' ``models/glm4_moe/modeling_glm4_moe.py``:

* Attention is plain GQA (no MLA): Megatron's ``SelfAttention`` of the GQA families, with
  * ``attention_bias`` a bias on q/k/v only (``o_proj`` has none): Megatron ``add_qkv_bias`` (as Qwen2);
  * ``use_qk_norm`` per-head q/k RMSNorm before RoPE (off in GLM-4.5/4.6): Megatron ``qk_layernorm``;
  * partial RoPE: ``rope_parameters["partial_rotary_factor"]`` (0.5 in GLM-4.5) rotates the first
    ``head_dim * factor`` channels of each head (non-interleaved halves, HF ``rotate_half``) and passes the
    rest: Megatron ``GPTModel(rotary_percent=factor)`` does exactly that (``rope_utils`` splits
    ``t[..., :rot_dim]`` / ``t[..., rot_dim:]``, inverse frequencies over ``rot_dim``).
* The MoE is DeepSeek-V3's: sigmoid scores + a per-expert score bias (``e_score_correction_bias``, frozen),
  group-limited top-k (``n_group``/``topk_group``; 1/1 in GLM-4.5, i.e. plain top-k), renormalised
  (``norm_topk_prob``) and scaled (``routed_scaling_factor``) weights, shared experts
  (``n_shared_experts * moe_intermediate_size``), the first ``first_k_dense_replace`` layers dense. Mapped
  and validated by :func:`megatron_rl.models.deepseek.sigmoid_router_fields`, same checkpoint names.
* MTP layers (``num_nextn_predict_layers``, stored as ``model.layers.{num_hidden_layers}.*``) are ignored
  as for DeepSeek-V3: HF's ``Glm4MoeForCausalLM`` drops them on load too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from megatron_rl.models import deepseek

MODEL_TYPE = "glm4_moe"


@dataclass(frozen=True)
class GLMArch:
    """The GLM-4.5 router, as read from the HF config (fields named as :class:`deepseek.MLAArch`'s)."""

    shared_expert_ffn: int  # n_shared_experts * moe_intermediate_size (0: none)
    router_groups: Optional[Tuple[int, int]]  # (n_group, topk_group); None: plain top-k
    routed_scaling_factor: float
    num_mtp_layers: int


def rotary_fraction(hf: Any) -> float:
    """HF ``partial_rotary_factor`` (transformers 5 keeps it in ``rope_parameters``; 4.x on the config)."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    factor = float(params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None) or 1.0))
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    rot = int(head_dim * factor)
    if not 0.0 < factor <= 1.0 or rot % 2:
        raise ValueError(f"{hf.model_type}: partial_rotary_factor={factor} with head_dim={head_dim} gives a rotary "
                         f"width of {rot}; it must be even and positive (0 < factor <= 1)")
    return factor


def hf_fields(hf: Any) -> Dict[str, Any]:
    """The :class:`~megatron_rl.models.config.HFArch` fields of a ``Glm4MoeConfig`` (validated)."""
    router = deepseek.sigmoid_router_fields(hf, MODEL_TYPE)
    glm = GLMArch(shared_expert_ffn=router["shared_expert_ffn"], router_groups=router["router_groups"],
                  routed_scaling_factor=router["routed_scaling_factor"], num_mtp_layers=router["num_mtp_layers"])
    return dict(glm=glm, qkv_bias=bool(getattr(hf, "attention_bias", False)),
                qk_norm=bool(getattr(hf, "use_qk_norm", False)), rotary_percent=rotary_fraction(hf),
                **router["moe"])


def transformer_kwargs(arch) -> Dict[str, Any]:
    """The sigmoid router's Megatron fields (attention is the GQA families')."""
    return deepseek.router_kwargs(arch.glm) if arch.is_moe else {}
