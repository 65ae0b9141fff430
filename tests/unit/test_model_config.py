"""HF config validation, vocabulary padding, divisibility errors and the HF <-> Megatron tensor algebra."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from megatron_rl.models.config import HFArch, ModelConfig, check_divisibility, padded_vocab_size
from megatron_rl.models.mapping import QKVLayout, hf_shapes, merge_glu
from megatron_rl.parallel import ParallelLayout

SMALL = dict(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def test_arch_reads_family_traits():
    q2 = HFArch.from_hf(Qwen2Config(**SMALL))
    q3 = HFArch.from_hf(Qwen3Config(**SMALL, head_dim=32, rope_theta=1e6))
    assert (q2.qkv_bias, q2.qk_norm, q2.head_dim) == (True, False, 16)
    assert (q3.qkv_bias, q3.qk_norm, q3.head_dim, q3.rope_theta) == (False, True, 32, 1e6)
    moe = HFArch.from_hf(Qwen3MoeConfig(**SMALL, num_experts=4, moe_intermediate_size=32,
                                        mlp_only_layers=[1], norm_topk_prob=False))
    assert (moe.num_experts, moe.moe_layers, moe.norm_topk_prob) == (4, (True, False), False)
    mix = HFArch.from_hf(MixtralConfig(**SMALL, num_local_experts=8))
    assert (mix.num_experts, mix.moe_ffn_hidden_size, mix.norm_topk_prob) == (8, 96, True)


def test_unsupported_inputs_raise_clear_errors():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="supported: llama, qwen2, qwen3, qwen3_moe, mixtral, deepseek_v3"):
        HFArch.from_hf(GPT2Config())
    with pytest.raises(ValueError, match="sliding-window"):
        HFArch.from_hf(Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=16))
    with pytest.raises(ValueError, match="attention_bias"):
        HFArch.from_hf(LlamaConfig(**SMALL, attention_bias=True))
    with pytest.raises(ValueError, match="RoPE type 'yarn'"):
        HFArch.from_hf(Qwen3Config(**SMALL, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}))
    with pytest.raises(ValueError, match="model.dtype"):
        ModelConfig(hf_path="x", dtype="float64")
    with pytest.raises(ValueError, match="moe_dispatcher"):
        ModelConfig(hf_path="x", moe_dispatcher="flex")


def test_llama3_rope_scaling_is_accepted_only_with_megatrons_constants():
    good = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert HFArch.from_hf(LlamaConfig(**SMALL, rope_parameters=good)).llama3_rope_factor == 8.0
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        HFArch.from_hf(LlamaConfig(**SMALL, rope_parameters={**good, "original_max_position_embeddings": 4096}))


def test_padded_vocab_size():
    assert padded_vocab_size(250, 128, 1) == 256
    assert padded_vocab_size(250, 128, 2) == 256
    assert padded_vocab_size(250, 128, 4) == 512
    assert padded_vocab_size(256, 128, 2) == 256
    assert padded_vocab_size(250, 1, 4) == 252
    assert padded_vocab_size(151936, 128, 8) == 152576


def test_divisibility_errors_name_the_numbers():
    arch = HFArch.from_hf(Qwen3Config(**SMALL))
    check_divisibility(arch, ParallelLayout(tp=2, pp=2))
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by the parallel size 8"):
        check_divisibility(arch, ParallelLayout(tp=8))
    with pytest.raises(ValueError, match="num_hidden_layers=2 is not divisible by the parallel size 4"):
        check_divisibility(arch, ParallelLayout(pp=4))
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        check_divisibility(HFArch.from_hf(Qwen3Config(**{**SMALL, "num_attention_heads": 6,
                                                        "num_key_value_heads": 3})), ParallelLayout(tp=2))
    with pytest.raises(ValueError, match="expert parallel size ep=2 given for the dense model"):
        check_divisibility(arch, ParallelLayout(ep=2))
    moe = HFArch.from_hf(Qwen3MoeConfig(**SMALL, num_experts=6, moe_intermediate_size=32))
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by the parallel size 4"):
        check_divisibility(moe, ParallelLayout(ep=4))


@pytest.mark.parametrize("heads,kv,tp", [(4, 2, 1), (4, 2, 2), (8, 2, 4), (4, 1, 2), (8, 1, 4)])
def test_qkv_interleave_split_and_rank_slices(heads, kv, tp):
    hd, H = 4, 5
    layout = QKVLayout(heads, kv, hd)
    q, k, v = torch.randn(heads * hd, H), torch.randn(kv * hd, H), torch.randn(kv * hd, H)
    fused = layout.interleave(q, k, v)
    # Megatron's order: for each KV group, its query heads, then k, then v.
    g = fused.view(kv, heads // kv + 2, hd, H)
    assert torch.equal(g[0, -2], k[:hd]) and torch.equal(g[-1, -1], v[-hd:])
    assert all(torch.equal(a, b) for a, b in zip(layout.split(fused), (q, k, v)))
    for rank in range(tp):  # a rank's rows, rebuilt from the groups covering them only
        r0, r1, g0, g1 = layout.rank_groups(rank, tp)
        qpg = heads // kv
        part = layout.interleave(q[g0 * qpg * hd : g1 * qpg * hd], k[g0 * hd : g1 * hd], v[g0 * hd : g1 * hd])
        base = g0 * layout.group_rows
        assert torch.equal(part[r0 - base : r1 - base], fused.chunk(tp)[rank])


def test_glu_merge_and_hf_names():
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    shards = [torch.cat([gate.chunk(2)[r], up.chunk(2)[r]]) for r in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(merge_glu(shards), (gate, up)))
    tied = hf_shapes(HFArch.from_hf(Qwen3Config(**SMALL, tie_word_embeddings=True)))
    assert "lm_head.weight" not in tied and tied["model.embed_tokens.weight"] == (250, 64)
    mix = hf_shapes(HFArch.from_hf(MixtralConfig(**SMALL, num_local_experts=2)))
    assert mix["model.layers.1.block_sparse_moe.experts.1.w2.weight"] == (64, 96)
    assert mix["model.layers.0.block_sparse_moe.gate.weight"] == (2, 64)


def test_te_spec_request_without_te_or_cuda_is_a_clear_error():
    pytest.importorskip("megatron.core")
    from megatron_rl.models.spec import resolve_layer_spec

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert resolve_layer_spec("auto") == "local"
    with pytest.raises(ValueError, match="layer_spec='te' needs transformer_engine"):
        resolve_layer_spec("te")


DEEPSEEK = dict(vocab_size=250, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=2,
                num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def test_deepseek_v3_arch_and_megatron_config():
    from transformers import DeepseekV3Config

    from megatron_rl.models.config import transformer_config

    arch = HFArch.from_hf(DeepseekV3Config(**DEEPSEEK))
    assert (arch.num_experts, arch.moe_topk, arch.moe_layers, arch.num_kv_heads) == (8, 4, (False, True, True), 4)
    assert (arch.mla.qk_head_dim, arch.mla.shared_expert_ffn, arch.mla.router_groups) == (24, 64, (4, 2))
    t = transformer_config(ModelConfig(hf_path="x"), arch, ParallelLayout(tp=2, ep=2), initialize=False)
    assert (t.multi_latent_attention, t.q_lora_rank, t.kv_lora_rank, t.qk_head_dim, t.qk_pos_emb_head_dim,
            t.v_head_dim, t.rope_type) == (True, 24, 32, 16, 8, 16, "rope")
    assert (t.moe_router_score_function, t.moe_router_enable_expert_bias, t.moe_router_bias_update_rate) == (
        "sigmoid", True, 0.0)
    assert (t.moe_router_num_groups, t.moe_router_group_topk, t.moe_router_topk_scaling_factor) == (4, 2, 2.5)
    assert (t.moe_shared_expert_intermediate_size, t.moe_layer_freq, t.mtp_num_layers) == (64, [0, 1, 1], None)
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    t = transformer_config(ModelConfig(hf_path="x"), HFArch.from_hf(DeepseekV3Config(
        **{**DEEPSEEK, "q_lora_rank": None, "rope_parameters": yarn})), ParallelLayout(), initialize=False)
    assert (t.q_lora_rank, t.rope_type, t.rotary_scaling_factor, t.mscale_all_dim) == (None, "yarn", 40.0, 1.0)


def test_deepseek_v3_hf_names_are_the_checkpoints(tmp_path):
    from safetensors import safe_open
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(**{**DEEPSEEK, "num_hidden_layers": 2, "hidden_size": 32, "vocab_size": 40})
    DeepseekV3ForCausalLM(cfg).save_pretrained(str(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert hf_shapes(HFArch.from_hf(cfg)) == saved


@pytest.mark.parametrize("field,value,match", [
    ("norm_topk_prob", False, "norm_topk_prob=False unsupported"),
    ("topk_group", 1, "group-limited routing with n_group=4, topk_group=1"),
    ("rope_interleave", False, "rope_interleave=False"),
    ("num_key_value_heads", 2, "num_key_value_heads=2 must equal num_attention_heads=4"),
])
def test_deepseek_v3_unsupported_variants_raise(field, value, match):
    from transformers import DeepseekV3Config

    with pytest.raises(ValueError, match=match):
        HFArch.from_hf(DeepseekV3Config(**{**DEEPSEEK, field: value}))


def test_deepseek_v3_divisibility_names_the_shared_expert_width():
    from transformers import DeepseekV3Config

    arch = HFArch.from_hf(DeepseekV3Config(**{**DEEPSEEK, "kv_lora_rank": 30, "n_shared_experts": 1,
                                              "moe_intermediate_size": 36}))
    check_divisibility(arch, ParallelLayout(tp=2))  # latent widths are not split over TP
    with pytest.raises(ValueError, match=r"moe ffn hidden size=36 is not divisible by the parallel size 8|shared expert width .*=36 is not divisible by the parallel size 8"):
        check_divisibility(HFArch.from_hf(DeepseekV3Config(**{**DEEPSEEK, "n_shared_experts": 1, "moe_intermediate_size": 36, "num_attention_heads": 8, "num_key_value_heads": 8})), ParallelLayout(tp=8))


def test_deepseek_v3_mtp_layers_are_ignored_with_a_warning():
    from transformers import DeepseekV3Config

    from megatron_rl.models.deepseek import warn_ignored_mtp

    arch = HFArch.from_hf(DeepseekV3Config(**DEEPSEEK, num_nextn_predict_layers=1))
    assert arch.mla.num_mtp_layers == 1 and all(not n.startswith("model.layers.3.") for n in hf_shapes(arch))
    names = list(hf_shapes(arch)) + ["model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight"]
    with pytest.warns(UserWarning, match="2 tensors of multi-token-prediction layers \\(model.layers.3\\+\\) are ignored"):
        warn_ignored_mtp(arch, names, "ckpt")
