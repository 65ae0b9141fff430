"""GLM-4.5-style MoE (HF glm4_moe): HF config -> HFArch -> Megatron TransformerConfig, checkpoint names, refusals."""

from __future__ import annotations

import pytest

from megatron_rl.config.sections import ModelConfig, ParallelLayout
from megatron_rl.models.config import HFArch, transformer_config
from megatron_rl.models.mapping import hf_shapes

GLM = dict(vocab_size=250, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_shared_experts=2,
           num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
           attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5)


def test_glm4_moe_arch_and_megatron_config():
    from transformers import Glm4MoeConfig

    arch = HFArch.from_hf(Glm4MoeConfig(**GLM))
    assert (arch.num_experts, arch.moe_topk, arch.moe_layers, arch.num_kv_heads, arch.head_dim) == (
        8, 2, (False, True, True), 2, 16)
    assert (arch.qkv_bias, arch.qk_norm, arch.rotary_percent, arch.mla) == (True, True, 0.5, None)
    assert (arch.glm.shared_expert_ffn, arch.glm.router_groups, arch.glm.routed_scaling_factor) == (64, (2, 1), 2.5)
    assert arch.sigmoid_router is arch.glm
    t = transformer_config(ModelConfig(hf_path="x"), arch, ParallelLayout(tp=2, ep=2), initialize=False)
    assert (t.add_qkv_bias, t.add_bias_linear, t.qk_layernorm, getattr(t, "multi_latent_attention", False)) == (
        True, False, True, False)
    assert (t.moe_router_score_function, t.moe_router_enable_expert_bias, t.moe_router_bias_update_rate) == (
        "sigmoid", True, 0.0)
    assert (t.moe_router_num_groups, t.moe_router_group_topk, t.moe_router_topk_scaling_factor) == (2, 1, 2.5)
    assert (t.moe_shared_expert_intermediate_size, t.moe_layer_freq) == (64, [0, 1, 1])
    # GLM-4.5's own defaults: no q/k norm, no groups (n_group = topk_group = 1: plain top-k)
    plain = HFArch.from_hf(Glm4MoeConfig(**{**GLM, "use_qk_norm": False, "n_group": 1, "topk_group": 1,
                                             "num_experts_per_tok": 4}))
    assert (plain.qk_norm, plain.glm.router_groups, plain.moe_topk) == (False, None, 4)
    t = transformer_config(ModelConfig(hf_path="x"), plain, ParallelLayout(), initialize=False)
    assert (t.qk_layernorm, t.moe_router_num_groups) == (False, None)


def test_glm4_moe_hf_names_are_the_checkpoints(tmp_path):
    from safetensors import safe_open
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    cfg = Glm4MoeConfig(**{**GLM, "num_hidden_layers": 2, "hidden_size": 32, "vocab_size": 40})
    Glm4MoeForCausalLM(cfg).save_pretrained(str(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert hf_shapes(HFArch.from_hf(cfg)) == saved
    assert "model.layers.1.self_attn.q_proj.bias" in saved and "model.layers.1.mlp.gate.e_score_correction_bias" in saved


@pytest.mark.parametrize("overrides,match", [
    (dict(norm_topk_prob=False), "glm4_moe: norm_topk_prob=False unsupported"),
    (dict(n_group=4, topk_group=2), "glm4_moe: group-limited routing with n_group=4, topk_group=2"),
    (dict(partial_rotary_factor=0.1), "glm4_moe: partial_rotary_factor=0.1 with head_dim=16 gives a rotary width of 1;"),
])
def test_glm4_moe_unsupported_variants_raise(overrides, match):
    from transformers import Glm4MoeConfig

    with pytest.raises(ValueError, match=match):
        HFArch.from_hf(Glm4MoeConfig(**{**GLM, **overrides}))
