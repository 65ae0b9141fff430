"""Qwen3-Next-style hybrids (HF ``model_type="qwen3_next"``): config and weight mapping; not yet buildable.

What the HF model is (transformers' ``models/qwen3_next/modeling_qwen3_next.py``):

* ``layer_types``: Gated-DeltaNet linear-attention layers (``linear_attn``: ``in_proj_qkvz``, ``in_proj_ba``, a
  depthwise causal ``conv1d``, ``dt_bias``, ``A_log``, a gated RMSNorm ``norm``, ``out_proj``) and, every
  ``full_attention_interval``-th layer, gated GQA attention (``q_proj`` emits ``[q_h | gate_h]`` per head, the
  output is multiplied by ``sigmoid(gate)``), with zero-centred q/k norms and partial RoPE (0.25 of each head).
* MoE on every layer (``decoder_sparse_step``/``mlp_only_layers`` as Qwen3-MoE): softmax top-k router, plus a
  shared expert scaled by ``sigmoid(shared_expert_gate(x))``.
* Every decoder RMSNorm is zero-centred (``x_hat * (1 + w)``, HF ``Qwen3NextRMSNorm``); the linear attention's
  gated norm is not (``x_hat * w * silu(z)``, ``Qwen3NextRMSNormGated``).

Megatron-Core 0.16.1's counterparts: ``experimental_attention_variant="gated_delta_net"`` with
``linear_attention_freq`` (``ssm/gated_delta_net.py``), ``attention_output_gate``, ``moe_shared_expert_gate``,
``layernorm_zero_centered_gamma``, ``GPTModel(rotary_percent=...)`` -- :func:`transformer_kwargs`.

Why it does not run on CPU (so :class:`~megatron_rl.models.config.HFArch` refuses it, naming this):

1. ``GatedDeltaNet.__init__`` raises ImportError without ``fla`` (flash-linear-attention), even where the
   forward would take its pure-torch path (``config.deterministic_mode``: ``nn.Conv1d`` +
   ``torch_chunk_gated_delta_rule``); that path still calls fla's Triton ``l2norm`` on q and k.
2. fla 0.5.2 (the wheel at hand) does not import with triton 3.9: ``fla/ops/cp/chunk_delta_h.py`` autotunes on a
   key ``BT`` that is not a kernel argument (ValueError at import). fla 0.6.0 imports, but its ``l2norm`` under
   ``TRITON_INTERPRET=1`` fails in triton's autotuner benchmark (``RuntimeError: 0 active drivers``).
3. ``GatedDeltaNet.__init__`` allocates ``conv1d``, ``dt_bias`` and ``A_log`` on ``torch.cuda.current_device()``.
4. Its forward raises NotImplementedError for packed sequences (``packed_seq_params``): the trainer would
   have to run with ``train.packing=false``.
5. Its spec (``get_gated_delta_net_module_spec``) wants a fused norm + column-parallel ``in_proj``, which the
   local backend does not provide (``LocalSpecProvider.column_parallel_layer_norm_linear()`` is None): our
   portable spec would need its own (input norm unfused, as for the other layers).

What is here and tested on CPU: the config reading, Megatron's fields, and the full-tensor HF <-> Megatron
weight conversion (:func:`hf_to_megatron` / :func:`megatron_to_hf`, TP=1 layout) with its round trip; the HF
parity of a built model is the GPU check's: ``python tools/gpu_check.py --sections gdn`` (tools/gpu_check_hybrid.py: one Gated-DeltaNet
layer against HF's), not yet run; the attention and MoE layers match HF on CPU
(tests/distributed/test_qwen3_next_parity.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, Tuple

import torch

from megatron_rl.models.glm import rotary_fraction

MODEL_TYPE = "qwen3_next"
UNSUPPORTED = (
    "qwen3_next (Gated-DeltaNet hybrid) cannot be built yet: Megatron-Core's GatedDeltaNet needs "
    "flash-linear-attention's Triton kernels and a CUDA device, and refuses packed sequences; see "
    "megatron_rl/models/qwen3_next.py for the config and weight mapping and what is left"
)


@dataclass(frozen=True)
class HybridArch:
    hidden_size: int
    ffn_hidden_size: int  # the dense MLP of mlp_only_layers
    num_layers: int
    linear_layers: Tuple[bool, ...]  # per layer: Gated-DeltaNet (True) or gated full attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_percent: float
    conv_kernel: int
    key_head_dim: int
    value_head_dim: int
    num_key_heads: int
    num_value_heads: int
    num_experts: int
    moe_topk: int
    moe_ffn_hidden_size: int
    shared_expert_ffn: int
    moe_layers: Tuple[bool, ...]

    @property
    def qk_dim(self) -> int:
        return self.key_head_dim * self.num_key_heads

    @property
    def v_dim(self) -> int:
        return self.value_head_dim * self.num_value_heads


def hf_fields(hf: Any) -> HybridArch:
    """The hybrid architecture of a ``Qwen3NextConfig`` (validated)."""
    types = list(hf.layer_types)
    bad = sorted(set(types) - {"linear_attention", "full_attention"})
    if bad or len(types) != hf.num_hidden_layers:
        raise ValueError(f"qwen3_next: layer_types must hold num_hidden_layers={hf.num_hidden_layers} entries of "
                         f"'linear_attention'/'full_attention'; got {len(types)} with unknown {bad}")
    if hf.linear_num_value_heads % hf.linear_num_key_heads:
        raise ValueError(f"qwen3_next: linear_num_value_heads={hf.linear_num_value_heads} must be a multiple of "
                         f"linear_num_key_heads={hf.linear_num_key_heads}")
    if not hf.norm_topk_prob:
        raise ValueError("qwen3_next: norm_topk_prob=False unsupported (the Qwen3-MoE mapping renormalises)")
    step, dense = getattr(hf, "decoder_sparse_step", 1) or 1, set(hf.mlp_only_layers or [])
    return HybridArch(
        hidden_size=hf.hidden_size, ffn_hidden_size=hf.intermediate_size, num_layers=hf.num_hidden_layers,
        linear_layers=tuple(t == "linear_attention" for t in types),
        num_heads=hf.num_attention_heads, num_kv_heads=hf.num_key_value_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        rotary_percent=rotary_fraction(hf), conv_kernel=hf.linear_conv_kernel_dim,
        key_head_dim=hf.linear_key_head_dim, value_head_dim=hf.linear_value_head_dim,
        num_key_heads=hf.linear_num_key_heads, num_value_heads=hf.linear_num_value_heads,
        num_experts=hf.num_experts, moe_topk=hf.num_experts_per_tok, moe_ffn_hidden_size=hf.moe_intermediate_size,
        shared_expert_ffn=hf.shared_expert_intermediate_size or 0,
        moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(hf.num_hidden_layers)),
    )


def transformer_kwargs(arch: HybridArch) -> Dict[str, Any]:
    """Megatron ``TransformerConfig`` fields of the hybrid (beside the Qwen3-MoE ones)."""
    return dict(
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[int(x) for x in arch.linear_layers],  # 1: linear attention, 0: full attention
        linear_conv_kernel_dim=arch.conv_kernel, linear_key_head_dim=arch.key_head_dim,
        linear_value_head_dim=arch.value_head_dim, linear_num_key_heads=arch.num_key_heads,
        linear_num_value_heads=arch.num_value_heads,
        attention_output_gate=True, qk_layernorm=True, layernorm_zero_centered_gamma=True,
        moe_shared_expert_intermediate_size=arch.shared_expert_ffn or None,
        moe_shared_expert_gate=bool(arch.shared_expert_ffn),
    )


# ------------------------------------------------------------------------------------------------
# Fused-tensor layouts (full tensors, TP=1; a TP rank holds the r-th slice of every part)
# ------------------------------------------------------------------------------------------------


def gdn_in_proj_to_megatron(arch: HybridArch, qkvz: torch.Tensor, ba: torch.Tensor) -> torch.Tensor:
    """HF ``in_proj_qkvz`` (per key head ``[q | k | v_group | z_group]``) and ``in_proj_ba`` (per key head
    ``[b_group | a_group]``) -> Megatron's ``in_proj`` rows ``[q | k | v | z | b | a]`` (each over all heads)."""
    nk, dk, dv, r = arch.num_key_heads, arch.key_head_dim, arch.value_head_dim, arch.num_value_heads // arch.num_key_heads
    g = qkvz.reshape(nk, 2 * dk + 2 * r * dv, -1)
    q, k, v, z = torch.split(g, [dk, dk, r * dv, r * dv], dim=1)
    b, a = torch.split(ba.reshape(nk, 2 * r, -1), [r, r], dim=1)
    return torch.cat([t.reshape(-1, t.shape[-1]) for t in (q, k, v, z, b, a)])


def gdn_in_proj_to_hf(arch: HybridArch, fused: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`gdn_in_proj_to_megatron`."""
    nk, dk, dv, nv = arch.num_key_heads, arch.key_head_dim, arch.value_head_dim, arch.num_value_heads
    r, H = nv // nk, fused.shape[-1]
    q, k, v, z, b, a = torch.split(fused, [nk * dk, nk * dk, nv * dv, nv * dv, nv, nv])
    qkvz = torch.cat([q.reshape(nk, dk, H), k.reshape(nk, dk, H), v.reshape(nk, r * dv, H),
                      z.reshape(nk, r * dv, H)], dim=1).reshape(-1, H)
    return qkvz, torch.cat([b.reshape(nk, r, H), a.reshape(nk, r, H)], dim=1).reshape(-1, H)


def gated_qkv_to_megatron(arch: HybridArch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF ``q_proj`` (per head ``[q_h | gate_h]``), ``k_proj``, ``v_proj`` -> Megatron's ``linear_qkv`` with an
    output gate: per KV group ``[q heads | gate heads | k | v]``."""
    hd, groups, qpg = arch.head_dim, arch.num_kv_heads, arch.num_heads // arch.num_kv_heads
    tail = q.shape[1:]
    qg = q.reshape(groups, qpg, 2, hd, *tail)
    parts = (qg[:, :, 0].reshape(groups, qpg * hd, *tail), qg[:, :, 1].reshape(groups, qpg * hd, *tail),
             k.reshape(groups, hd, *tail), v.reshape(groups, hd, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def gated_qkv_to_hf(arch: HybridArch, fused: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`gated_qkv_to_megatron`."""
    hd, groups, qpg = arch.head_dim, arch.num_kv_heads, arch.num_heads // arch.num_kv_heads
    tail = fused.shape[1:]
    q, gate, k, v = torch.split(fused.reshape(groups, (2 * qpg + 2) * hd, *tail), [qpg * hd, qpg * hd, hd, hd], dim=1)
    qh = torch.stack([q.reshape(groups, qpg, hd, *tail), gate.reshape(groups, qpg, hd, *tail)], dim=2)
    return qh.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


# ------------------------------------------------------------------------------------------------
# Names: HF checkpoint <-> Megatron GPTModel state dict (local-spec names: norms unfused)
# ------------------------------------------------------------------------------------------------

# One-to-one tensors: HF suffix -> Megatron suffix (within a layer).
_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "linear_attn.conv1d.weight": "self_attention.conv1d.weight",
    "linear_attn.dt_bias": "self_attention.dt_bias",
    "linear_attn.A_log": "self_attention.A_log",
    # Megatron builds out_norm from the same config: zero-centred there, plain in HF (Qwen3NextRMSNormGated)
    "linear_attn.norm.weight": "self_attention.out_norm.weight",
    "linear_attn.out_proj.weight": "self_attention.out_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "mlp.gate.weight": "mlp.router.weight",
    "mlp.shared_expert.down_proj.weight": "mlp.shared_experts.linear_fc2.weight",
    "mlp.shared_expert_gate.weight": "mlp.shared_experts.gate_weight",
}
_GLOBAL = {"model.embed_tokens.weight": "embedding.word_embeddings.weight",
           "model.norm.weight": "decoder.final_layernorm.weight", "lm_head.weight": "output_layer.weight"}
_OUT_NORM_OFFSET = 1.0  # Megatron's zero-centred out_norm holds w - 1 (an assumption the GPU parity must confirm)
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def hf_to_megatron(arch: HybridArch, hf: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """An HF checkpoint's tensors (per-expert names) -> Megatron's full (TP=1) state-dict tensors."""
    out: Dict[str, torch.Tensor] = {}
    for name, meg in _GLOBAL.items():
        if name in hf:
            out[meg] = hf[name]
    for i in range(arch.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for suffix, meg in _DIRECT.items():
            if p + suffix in hf:
                t = hf[p + suffix]
                out[m + meg] = t - _OUT_NORM_OFFSET if suffix == "linear_attn.norm.weight" else t
        if arch.linear_layers[i]:
            out[m + "self_attention.in_proj.weight"] = gdn_in_proj_to_megatron(
                arch, hf[p + "linear_attn.in_proj_qkvz.weight"], hf[p + "linear_attn.in_proj_ba.weight"])
        else:
            a = p + "self_attn."
            out[m + "self_attention.linear_qkv.weight"] = gated_qkv_to_megatron(
                arch, hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"])
        if arch.moe_layers[i]:
            for e in range(arch.num_experts):
                x = f"{p}mlp.experts.{e}."
                out[f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.cat(
                    [hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"]])
                out[f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight"] = hf[x + "down_proj.weight"]
            if arch.shared_expert_ffn:
                s = p + "mlp.shared_expert."
                out[m + "mlp.shared_experts.linear_fc1.weight"] = torch.cat([hf[s + "gate_proj.weight"],
                                                                             hf[s + "up_proj.weight"]])
        else:
            x = p + "mlp."
            out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"]])
            out[m + "mlp.linear_fc2.weight"] = hf[x + "down_proj.weight"]
    return out


def megatron_to_hf(arch: HybridArch, meg: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_megatron` (HF checkpoint names, per-expert)."""
    out: Dict[str, torch.Tensor] = {}
    for name, m in _GLOBAL.items():
        if m in meg:
            out[name] = meg[m]
    for i in range(arch.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for suffix, msuffix in _DIRECT.items():
            if m + msuffix in meg:
                t = meg[m + msuffix]
                out[p + suffix] = t + _OUT_NORM_OFFSET if suffix == "linear_attn.norm.weight" else t
        if arch.linear_layers[i]:
            qkvz, ba = gdn_in_proj_to_hf(arch, meg[m + "self_attention.in_proj.weight"])
            out[p + "linear_attn.in_proj_qkvz.weight"], out[p + "linear_attn.in_proj_ba.weight"] = qkvz, ba
        else:
            q, k, v = gated_qkv_to_hf(arch, meg[m + "self_attention.linear_qkv.weight"])
            a = p + "self_attn."
            out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = q, k, v
        if arch.moe_layers[i]:
            for e in range(arch.num_experts):
                x = f"{p}mlp.experts.{e}."
                gate, up = meg[f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight"].chunk(2)
                out[x + "gate_proj.weight"], out[x + "up_proj.weight"] = gate, up
                out[x + "down_proj.weight"] = meg[f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight"]
            if arch.shared_expert_ffn:
                gate, up = meg[m + "mlp.shared_experts.linear_fc1.weight"].chunk(2)
                out[p + "mlp.shared_expert.gate_proj.weight"], out[p + "mlp.shared_expert.up_proj.weight"] = gate, up
        else:
            gate, up = meg[m + "mlp.linear_fc1.weight"].chunk(2)
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
            out[p + "mlp.down_proj.weight"] = meg[m + "mlp.linear_fc2.weight"]
    return out


def megatron_shapes(arch: HybridArch, vocab: int, tied: bool) -> Dict[str, Tuple[int, ...]]:
    """Full (TP=1) shapes of the Megatron tensors, as ``ssm/gated_delta_net.py`` and ``attention.py`` build them."""
    H, out = arch.hidden_size, {"embedding.word_embeddings.weight": (vocab, arch.hidden_size),
                                "decoder.final_layernorm.weight": (arch.hidden_size,)}
    if not tied:
        out["output_layer.weight"] = (vocab, H)
    conv = 2 * arch.qk_dim + arch.v_dim
    for i in range(arch.num_layers):
        m = f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = (H,)
        out[m + "pre_mlp_layernorm.weight"] = (H,)
        if arch.linear_layers[i]:
            s = m + "self_attention."
            out.update({s + "in_proj.weight": (2 * arch.qk_dim + 2 * arch.v_dim + 2 * arch.num_value_heads, H),
                        s + "conv1d.weight": (conv, 1, arch.conv_kernel), s + "dt_bias": (arch.num_value_heads,),
                        s + "A_log": (arch.num_value_heads,), s + "out_norm.weight": (arch.value_head_dim,),
                        s + "out_proj.weight": (H, arch.v_dim)})
        else:
            s, hd = m + "self_attention.", arch.head_dim
            out.update({s + "linear_qkv.weight": ((2 * arch.num_heads + 2 * arch.num_kv_heads) * hd, H),
                        s + "q_layernorm.weight": (hd,), s + "k_layernorm.weight": (hd,),
                        s + "linear_proj.weight": (H, arch.num_heads * hd)})
        if arch.moe_layers[i]:
            F = arch.moe_ffn_hidden_size
            out[m + "mlp.router.weight"] = (arch.num_experts, H)
            for e in range(arch.num_experts):
                out[f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight"] = (2 * F, H)
                out[f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight"] = (H, F)
            if arch.shared_expert_ffn:
                S = arch.shared_expert_ffn
                out.update({m + "mlp.shared_experts.linear_fc1.weight": (2 * S, H),
                            m + "mlp.shared_experts.linear_fc2.weight": (H, S),
                            m + "mlp.shared_experts.gate_weight": (1, H)})
        else:
            out.update({m + "mlp.linear_fc1.weight": (2 * arch.ffn_hidden_size, H),
                        m + "mlp.linear_fc2.weight": (H, arch.ffn_hidden_size)})
    return out
