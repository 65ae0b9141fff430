"""Qwen3-Next-style hybrid (HF qwen3_next): config -> Megatron fields, and the HF <-> Megatron weight mapping.

Megatron-Core's GatedDeltaNet cannot be built on CPU (megatron_rl/models/qwen3_next.py says why), so the mapping
is checked against the two real ends it can reach here: HF's own checkpoint (names, shapes, values round trip)
and HF's own split code (``fix_query_key_value_ordering``, the gated q_proj chunking), against the split
Megatron's forward applies (``gated_delta_net.py``: ``[q | k | v | z | b | a]``; ``attention.py``: per KV group
``[q heads | gate heads | k | v]``).
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.models import qwen3_next
from megatron_rl.models.config import HFArch

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=8,
            linear_value_head_dim=6, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24, mlp_only_layers=[1],
            layer_types=["linear_attention", "linear_attention", "full_attention"], partial_rotary_factor=0.25)


def _same(a, b):  # float64 products of the same rows: equal up to summation order; a wrong row order is O(1) off
    return a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-12)


def _model():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(**TINY)
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return cfg, model


def test_qwen3_next_is_refused_naming_why_and_maps_to_megatron_fields():
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig(**TINY)
    with pytest.raises(ValueError, match="qwen3_next .Gated-DeltaNet hybrid. cannot be built yet: .*flash-linear-attention"):
        HFArch.from_hf(cfg)
    arch = qwen3_next.hf_fields(cfg)
    assert (arch.linear_layers, arch.moe_layers, arch.rotary_percent) == ((True, True, False), (True, False, True), 0.25)
    kw = qwen3_next.transformer_kwargs(arch)
    assert kw["linear_attention_freq"] == [1, 1, 0] and kw["attention_output_gate"] and kw["moe_shared_expert_gate"]
    # Megatron's own validation of the hybrid fields (TransformerConfig.__post_init__)
    t = TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                          num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, normalization="RMSNorm",
                          use_cpu_initialization=True, **kw)
    assert (t.experimental_attention_variant, t.linear_num_value_heads, t.layernorm_zero_centered_gamma) == (
        "gated_delta_net", 4, True)
    with pytest.raises(ValueError, match="linear_num_value_heads=3 must be a multiple of linear_num_key_heads=2"):
        qwen3_next.hf_fields(Qwen3NextConfig(**{**TINY, "linear_num_value_heads": 3}))


def test_qwen3_next_checkpoint_round_trips_through_megatron_names(tmp_path):
    from safetensors.torch import load_file

    cfg, model = _model()
    model.save_pretrained(str(tmp_path))
    hf = load_file(str(tmp_path / "model.safetensors"))  # checkpoint names: per-expert tensors
    arch = qwen3_next.hf_fields(cfg)
    meg = qwen3_next.hf_to_megatron(arch, hf)
    assert {k: tuple(v.shape) for k, v in meg.items()} == qwen3_next.megatron_shapes(arch, cfg.vocab_size, False)
    back = qwen3_next.megatron_to_hf(arch, meg)
    assert sorted(back) == sorted(hf)
    # the gated norm is not zero-centred in HF, Megatron's out_norm is: stored as w - 1 (float rounding on the way back)
    shifted = {k for k in hf if k.endswith("linear_attn.norm.weight")}
    assert len(shifted) == 2 and all(torch.equal(back[k], hf[k]) for k in hf if k not in shifted)
    assert all(torch.allclose(back[k], hf[k], rtol=0, atol=1e-7) for k in shifted)
    assert torch.allclose(meg["decoder.layers.0.self_attention.out_norm.weight"] + 1,
                          hf["model.layers.0.linear_attn.norm.weight"], rtol=0, atol=1e-7)


def test_gdn_in_proj_split_equals_hfs_own_ordering():
    _, model = _model()
    gdn = model.model.layers[0].linear_attn
    arch = qwen3_next.hf_fields(model.config)
    fused = qwen3_next.gdn_in_proj_to_megatron(arch, gdn.in_proj_qkvz.weight.detach(), gdn.in_proj_ba.weight.detach())
    x = torch.randn(2, 5, arch.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        q, k, v, z, b, a = gdn.fix_query_key_value_ordering(x @ gdn.in_proj_qkvz.weight.double().T,
                                                            x @ gdn.in_proj_ba.weight.double().T)
    # Megatron's forward: split [qk, qk, v, v, nv, nv], then heads
    mq, mk, mv, mz, mb, ma = torch.split(x @ fused.double().T, [arch.qk_dim, arch.qk_dim, arch.v_dim, arch.v_dim,
                                                                arch.num_value_heads, arch.num_value_heads], dim=-1)
    assert _same(mq.reshape(q.shape), q) and _same(mk.reshape(k.shape), k)
    assert _same(mv.reshape(v.shape), v) and _same(mz.reshape(z.shape), z)
    assert _same(mb, b) and _same(ma, a)


def test_gated_qkv_split_equals_hfs_own_chunking():
    _, model = _model()
    attn = model.model.layers[2].self_attn
    arch = qwen3_next.hf_fields(model.config)
    w = {n: getattr(attn, n).weight.detach().double() for n in ("q_proj", "k_proj", "v_proj")}
    fused = qwen3_next.gated_qkv_to_megatron(arch, w["q_proj"], w["k_proj"], w["v_proj"])
    x = torch.randn(5, arch.hidden_size, dtype=torch.float64)
    hd, g, qpg = arch.head_dim, arch.num_kv_heads, arch.num_heads // arch.num_kv_heads
    # HF: q_proj(x).view(..., heads, 2 * hd).chunk(2, -1) -> query, gate
    query, gate = torch.chunk((x @ w["q_proj"].T).view(5, arch.num_heads, 2 * hd), 2, dim=-1)
    # Megatron: [s, ng, (2 * np/ng + 2) * hn] split into np/ng*hn, np/ng*hn, hn, hn
    mq, mg, mk, mv = torch.split((x @ fused.T).view(5, g, (2 * qpg + 2) * hd), [qpg * hd, qpg * hd, hd, hd], dim=-1)
    assert _same(mq.reshape(5, arch.num_heads, hd), query) and _same(mg.reshape(5, arch.num_heads, hd), gate)
    assert _same(mk.reshape(5, g, hd), (x @ w["k_proj"].T).view(5, g, hd))
    assert _same(mv.reshape(5, g, hd), (x @ w["v_proj"].T).view(5, g, hd))
