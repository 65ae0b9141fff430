"""DeepSeek-V3-style models (HF ``model_type="deepseek_v3"``): what differs from the GQA families.

* Multi-latent attention (MLA), with or without a query LoRA rank: Megatron-Core's ``MLASelfAttention``
  (``transformer/multi_latent_attention.py``) with our portable core attention and RMSNorm.
* MoE layers with a shared expert (Megatron's ``SharedExpertMLP``) and a sigmoid router with a per-expert
  score bias (HF ``e_score_correction_bias``, Megatron ``expert_bias``) and group-limited top-k; the first
  ``first_k_dense_replace`` layers are dense (Megatron ``moe_layer_freq``).
* Multi-token-prediction (MTP) layers are **ignored**: HF's ``DeepseekV3ForCausalLM`` does not build them
  either (it drops ``model.layers.{num_hidden_layers}.*`` on load). We neither load, train nor export them;
  a checkpoint that holds them gets a warning naming how many tensors were skipped, and an exported
  checkpoint has no MTP weights (its ``config.json`` still says ``num_nextn_predict_layers``: SGLang's
  speculative decoding would then need the original MTP weights).

Numerics that decide what is accepted (else ValueError naming the field):

* RoPE must be interleaved (HF ``rope_interleave=True``, DeepSeek's layout): Megatron's MLA always
  de-interleaves the rotary half of q and k.
* Megatron renormalises sigmoid top-k weights whenever top-k > 1: ``norm_topk_prob=False`` is refused.
* Megatron ranks groups by the sum of their top ``topk / topk_group`` scores; HF by the top 2: group-limited
  routing is accepted only where they agree (``num_experts_per_tok == 2 * topk_group``, as DeepSeek-V3's 8/4).
* The expert bias is frozen (``moe_router_bias_update_rate=0``): RL fine-tuning keeps the pre-trained
  auxiliary-loss-free balance; a non-zero rate can be set in ``model.transformer_overrides``.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

logger = logging.getLogger(__name__)

MODEL_TYPE = "deepseek_v3"


@dataclass(frozen=True)
class MLAArch:
    """Multi-latent attention and the DeepSeek router, as read from the HF config."""

    q_lora_rank: Optional[int]  # None: a plain q projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: Tuple[Tuple[str, Any], ...]  # Megatron MLA RoPE fields (rope_type, rotary_base, yarn parameters)
    shared_expert_ffn: int  # n_shared_experts * moe_intermediate_size (0: none)
    router_groups: Optional[Tuple[int, int]]  # (n_group, topk_group); None: plain top-k
    routed_scaling_factor: float
    num_mtp_layers: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _rope_fields(hf: Any) -> Dict[str, Any]:
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "default":
        return dict(rope_type="rope", rotary_base=theta)
    if rope_type == "yarn":
        return dict(
            rope_type="yarn", rotary_base=theta, rotary_scaling_factor=float(params["factor"]),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings") or 4096),
            beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
            mscale=float(params.get("mscale") or 1.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        )
    raise ValueError(f"deepseek_v3: RoPE type {rope_type!r} unsupported; supported: 'default', 'yarn'")


def hf_fields(hf: Any) -> Dict[str, Any]:
    """The :class:`~megatron_rl.models.config.HFArch` fields of a ``DeepseekV3Config`` (validated)."""
    heads, kv_heads = hf.num_attention_heads, getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    if kv_heads != heads:
        raise ValueError(f"deepseek_v3: num_key_value_heads={kv_heads} must equal num_attention_heads={heads} "
                         "(MLA expands its latent to every head)")
    if not getattr(hf, "rope_interleave", True):
        raise ValueError("deepseek_v3: rope_interleave=False unsupported (Megatron's MLA applies interleaved RoPE)")
    router = sigmoid_router_fields(hf, MODEL_TYPE)
    mla = MLAArch(
        q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank, qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
        rope=tuple(sorted(_rope_fields(hf).items())),
        shared_expert_ffn=router["shared_expert_ffn"], router_groups=router["router_groups"],
        routed_scaling_factor=router["routed_scaling_factor"], num_mtp_layers=router["num_mtp_layers"],
    )
    return dict(head_dim=hf.v_head_dim, num_kv_heads=heads, mla=mla, **router["moe"])


def sigmoid_router_fields(hf: Any, family: str) -> Dict[str, Any]:
    """The MoE fields shared by the DeepSeek-V3 and GLM-4.5 families (sigmoid scores + score bias,
    group-limited top-k, shared experts, dense first layers, MTP layers), validated; errors name ``family``."""
    topk, experts = hf.num_experts_per_tok, hf.n_routed_experts
    if topk > 1 and not hf.norm_topk_prob:
        raise ValueError(f"{family}: norm_topk_prob=False unsupported (Megatron renormalises sigmoid top-k "
                         "weights when num_experts_per_tok > 1)")
    n_group, topk_group = hf.n_group or 1, hf.topk_group or 1
    groups = None
    if n_group > 1 and topk_group < n_group:
        if experts % n_group or topk % topk_group or topk // topk_group != 2:
            raise ValueError(
                f"{family}: group-limited routing with n_group={n_group}, topk_group={topk_group}, "
                f"num_experts_per_tok={topk}, n_routed_experts={experts} unsupported: HF ranks groups by their "
                "top-2 scores, Megatron by their top topk/topk_group; they agree when num_experts_per_tok == "
                "2 * topk_group and n_group divides n_routed_experts")
        groups = (n_group, topk_group)
    mtp = int(getattr(hf, "num_nextn_predict_layers", None) or getattr(hf, "num_mtp_layers", 0) or 0)
    if mtp:
        logger.info("%s: num_nextn_predict_layers=%d: MTP layers are ignored (not loaded, trained or "
                    "exported), as in HF's modeling", family, mtp)
    first_dense = hf.first_k_dense_replace or 0
    return dict(
        shared_expert_ffn=(hf.n_shared_experts or 0) * hf.moe_intermediate_size, router_groups=groups,
        routed_scaling_factor=float(hf.routed_scaling_factor or 1.0), num_mtp_layers=mtp,
        moe=dict(num_experts=experts, moe_topk=topk, moe_ffn_hidden_size=hf.moe_intermediate_size,
                 norm_topk_prob=bool(hf.norm_topk_prob),
                 moe_layers=tuple(i >= first_dense for i in range(hf.num_hidden_layers))),
    )


def divisibility_checks(arch, tp: int) -> List[Tuple[str, int, int]]:
    # the MLA latent down projections are replicated over TP: any widths split
    router, out = arch.sigmoid_router, []
    if router.shared_expert_ffn:
        out.append(("shared expert width (n_shared_experts * moe_intermediate_size)", router.shared_expert_ffn, tp))
    return out


def transformer_kwargs(arch) -> Dict[str, Any]:
    """MLA + router fields of Megatron's ``MLATransformerConfig`` (MTP stays off: ``mtp_num_layers=None``)."""
    mla = arch.mla
    kw: Dict[str, Any] = dict(
        multi_latent_attention=True, q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim, qk_pos_emb_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
        qk_layernorm=True,  # the q/kv latent norms (the TE spec includes them only with this set)
        mtp_num_layers=None, **dict(mla.rope),
    )
    if arch.is_moe:
        kw.update(router_kwargs(mla))
    return kw


def router_kwargs(router) -> Dict[str, Any]:
    """Megatron's MoE router fields for a sigmoid router (``MLAArch`` or ``glm.GLMArch``)."""
    kw: Dict[str, Any] = dict(
        moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0,
        moe_router_topk_scaling_factor=router.routed_scaling_factor,
        moe_shared_expert_intermediate_size=router.shared_expert_ffn or None,
    )
    if router.router_groups:
        kw.update(moe_router_num_groups=router.router_groups[0], moe_router_group_topk=router.router_groups[1])
    return kw


# ------------------------------------------------------------------------------------------------
# Layer spec (portable "local" spec; the TE spec comes from Megatron's get_gpt_decoder_block_spec)
# ------------------------------------------------------------------------------------------------


def _mla_core_attention():
    from megatron_rl.models.attention import SDPACoreAttention

    class MLASDPACoreAttention(SDPACoreAttention):
        """:class:`SDPACoreAttention` for MLA, whose values are narrower than its queries/keys
        (``v_head_dim`` < ``qk_head_dim``): values are zero-padded to the key width and the padding is cut
        from the output, so padded, packed and context-parallel inputs all take the parent's paths."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type="self", attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
            super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout,
                             softmax_scale, cp_comm_type, pg_collection)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            hk, hv = key.shape[-1], value.shape[-1]
            if hv < hk:
                value = torch.nn.functional.pad(value, (0, hk - hv))
            out = super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                  packed_seq_params)
            if hv < hk:
                lead, heads = out.shape[:-1], query.shape[-2]
                out = out.view(*lead, heads, hk)[..., :hv].reshape(*lead, heads * hv)
            return out

    return MLASDPACoreAttention


def local_layer_spec(moe_mlp_spec, dense_mlp_spec, norm, is_moe: bool, q_lora: bool = True):
    """One MLA decoder layer of the portable spec (Megatron's own modules but for core attention and norm).
    Without q-LoRA there is no query norm (megatron-core >= 0.19 refuses one given)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=MLASelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=MLASelfAttentionSubmodules(
                    linear_q_proj=ColumnParallelLinear,
                    # The down projections are replicated over TP (as the TE spec's "duplicated" TELinear):
                    # split over TP (ColumnParallelLinear, Megatron's local spec), the rotary key's gradient
                    # keeps only this rank's heads' share (its gather's backward is a plain split), so the
                    # gradients at TP=2 came out ~5 % off while the forward matched.
                    linear_q_down_proj=Linear,
                    linear_q_up_proj=ColumnParallelLinear,
                    linear_kv_down_proj=Linear,
                    linear_kv_up_proj=ColumnParallelLinear,
                    core_attention=_mla_core_attention(),
                    linear_proj=RowParallelLinear,
                    q_layernorm=norm if q_lora else IdentityOp,
                    kv_layernorm=norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=moe_mlp_spec if is_moe else dense_mlp_spec,
            mlp_bda=get_bias_dropout_add,
        ),
    )


# ------------------------------------------------------------------------------------------------
# HF <-> Megatron mapping (units are megatron_rl.models.mapping.Unit)
# ------------------------------------------------------------------------------------------------


def attention_units(unit_cls, arch, layer: int) -> list:
    """The MLA parameters of one layer (after its input norm), HF checkpoint names and full shapes."""
    mla, H, n = arch.mla, arch.hidden_size, arch.num_heads
    a = f"model.layers.{layer}.self_attn."
    U = unit_cls
    out = []
    if mla.q_lora_rank is None:
        out.append(U("column", "q_proj", layer, ((a + "q_proj.weight", (n * mla.qk_head_dim, H)),)))
    else:
        r = mla.q_lora_rank
        out += [U("replicated", "q_down", layer, ((a + "q_a_proj.weight", (r, H)),)),
                U("replicated", "q_down_norm", layer, ((a + "q_a_layernorm.weight", (r,)),)),
                U("column", "q_up", layer, ((a + "q_b_proj.weight", (n * mla.qk_head_dim, r)),))]
    kv = mla.kv_lora_rank
    out += [U("replicated", "kv_down", layer, ((a + "kv_a_proj_with_mqa.weight", (kv + mla.qk_rope_head_dim, H)),)),
            U("replicated", "kv_down_norm", layer, ((a + "kv_a_layernorm.weight", (kv,)),)),
            U("column", "kv_up", layer, ((a + "kv_b_proj.weight", (n * (mla.qk_nope_head_dim + mla.v_head_dim), kv)),)),
            U("row", "attn_out", layer, ((a + "o_proj.weight", (H, n * mla.v_head_dim)),))]
    return out


def moe_extra_units(unit_cls, arch, layer: int) -> list:
    """The router's score bias and the shared expert of one MoE layer."""
    m = f"model.layers.{layer}.mlp."
    out = [unit_cls("replicated", "expert_bias", layer, ((m + "gate.e_score_correction_bias", (arch.num_experts,)),))]
    F, H = arch.sigmoid_router.shared_expert_ffn, arch.hidden_size
    if F:
        s = m + "shared_experts."
        out += [unit_cls("glu", "shared_fc1", layer, ((s + "gate_proj.weight", (F, H)), (s + "up_proj.weight", (F, H)))),
                unit_cls("row", "shared_fc2", layer, ((s + "down_proj.weight", (H, F)),))]
    return out


def _norm(norm, fused_owner):
    w = getattr(norm, "weight", None)
    return w if isinstance(w, torch.nn.Parameter) else fused_owner.layer_norm_weight  # TE fuses it


LOCATORS: Dict[str, Callable[[Any], torch.Tensor]] = {
    "q_proj": lambda lm: lm.self_attention.linear_q_proj.weight,
    "q_down": lambda lm: lm.self_attention.linear_q_down_proj.weight,
    "q_down_norm": lambda lm: _norm(lm.self_attention.q_layernorm, lm.self_attention.linear_q_up_proj),
    "q_up": lambda lm: lm.self_attention.linear_q_up_proj.weight,
    "kv_down": lambda lm: lm.self_attention.linear_kv_down_proj.weight,
    "kv_down_norm": lambda lm: _norm(lm.self_attention.kv_layernorm, lm.self_attention.linear_kv_up_proj),
    "kv_up": lambda lm: lm.self_attention.linear_kv_up_proj.weight,
    "expert_bias": lambda lm: lm.mlp.router.expert_bias,  # a float32 buffer, not a parameter
    "shared_fc1": lambda lm: lm.mlp.shared_experts.linear_fc1.weight,
    "shared_fc2": lambda lm: lm.mlp.shared_experts.linear_fc2.weight,
}
FLOAT32_ROLES = frozenset({"expert_bias"})  # kept (and exported) in float32 whatever the model dtype

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def warn_ignored_mtp(arch, names: Iterable[str], path: str) -> None:
    """Warn when the checkpoint holds layers past ``num_hidden_layers`` (DeepSeek's MTP layers)."""
    extra = [n for n in names if (m := _LAYER.match(n)) and int(m.group(1)) >= arch.num_layers]
    if extra:
        warnings.warn(f"{path}: {len(extra)} tensors of multi-token-prediction layers (model.layers."
                      f"{arch.num_layers}+) are ignored: MTP is neither trained nor exported", stacklevel=3)
