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

    with pytest.raises(ValueError, match="supported: llama, qwen2, qwen3, qwen3_moe, mixtral"):
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
