"""The part of a Qwen3-Next-style hybrid that runs on CPU == HF: gated full attention (q_proj emits a per-head
sigmoid output gate; zero-centred q/k norms; partial RoPE over a quarter of each head), MoE with a
sigmoid-gated shared expert, zero-centred decoder norms, one dense layer (mlp_only_layers).

A tiny ``Qwen3NextForCausalLM`` whose ``layer_types`` are all ``full_attention`` (the Gated-DeltaNet layers
cannot be built on CPU: megatron_rl/models/qwen3_next.py) is loaded into a Megatron ``GPTModel`` through
:func:`qwen3_next.hf_to_megatron` and the Megatron fields of :func:`qwen3_next.transformer_kwargs` (our portable
layer spec); float32 logits and every gradient, mapped back by :func:`qwen3_next.megatron_to_hf`, match HF's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from multiproc import run_distributed

from model_helpers import hf_model, make_inputs
from test_model_pipeline_backward import _checkpoint_names

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, mlp_only_layers=[1], partial_rotary_factor=0.25,
            layer_types=["full_attention"] * 3, rope_theta=1e4, max_position_embeddings=256)
GDN_FIELDS = ("experimental_attention_variant", "linear_attention_freq", "linear_conv_kernel_dim",
              "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads")


def _checkpoint(path):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**TINY)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if name.endswith("norm.weight") else 0.1)  # zero-centred norms: around 0
    model.save_pretrained(path)
    return path


def _child(path, ids, labels):
    from megatron.core.models.gpt import GPTModel
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from megatron_rl import compat, parallel
    from megatron_rl.models import qwen3_next
    from megatron_rl.models.config import HFArch, ModelConfig, transformer_config
    from megatron_rl.models.spec import decoder_block_spec

    groups = parallel.init_megatron_parallel(parallel.ParallelLayout())
    compat.apply()
    hf = AutoConfig.from_pretrained(path)
    hybrid = qwen3_next.hf_fields(hf)
    # the attention + MoE part as the Qwen3-MoE family, plus the hybrid's own fields but Gated-DeltaNet's
    arch = HFArch(model_type="qwen3_moe", vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
                  ffn_hidden_size=hf.intermediate_size, num_layers=hf.num_hidden_layers,
                  num_heads=hf.num_attention_heads, num_kv_heads=hf.num_key_value_heads, head_dim=hf.head_dim,
                  rms_norm_eps=hf.rms_norm_eps, rope_theta=1e4, llama3_rope_factor=None,
                  max_position_embeddings=hf.max_position_embeddings, tie_word_embeddings=False, qkv_bias=False,
                  qk_norm=True, init_std=0.02, num_experts=hybrid.num_experts, moe_topk=hybrid.moe_topk,
                  moe_ffn_hidden_size=hybrid.moe_ffn_hidden_size, norm_topk_prob=True, moe_layers=hybrid.moe_layers,
                  rotary_percent=hybrid.rotary_percent)
    overrides = {k: v for k, v in qwen3_next.transformer_kwargs(hybrid).items() if k not in GDN_FIELDS}
    cfg = ModelConfig(hf_path=path, transformer_overrides=overrides)
    tconfig = transformer_config(cfg, arch, groups.layout)
    model = GPTModel(config=tconfig, transformer_layer_spec=decoder_block_spec(cfg, tconfig, 0),
                     vocab_size=hf.vocab_size, max_sequence_length=hf.max_position_embeddings,
                     position_embedding_type="rope", rotary_base=1e4, rotary_percent=arch.rotary_percent)
    missing, unexpected = model.load_state_dict(qwen3_next.hf_to_megatron(hybrid, load_file(f"{path}/model.safetensors")),
                                                strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    logits = model(ids, pos, attention_mask=None)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()
    grads = qwen3_next.megatron_to_hf(hybrid, {n: p.grad for n, p in model.named_parameters()})
    return {"logits": logits.detach(), "grads": grads}


@pytest.mark.timeout(300)
def test_qwen3_next_attention_and_moe_layers_match_hf(tmp_path):
    path = _checkpoint(str(tmp_path / "qwen3_next"))
    ids, labels = make_inputs(128, seed=1), make_inputs(128, seed=2)
    ref = hf_model(path)
    logits = ref(ids).logits
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()
    ref_grads = _checkpoint_names({n: p.grad for n, p in ref.named_parameters()})

    out, = run_distributed(_child, 1, path, ids, labels, timeout_s=280)
    logit_err = (out["logits"] - logits.detach()).abs().max().item()
    assert sorted(out["grads"]) == sorted(ref_grads)
    grad_err = {n: (out["grads"][n] - g).abs().max().item() for n, g in ref_grads.items()}
    print(f"\nQwen3-Next (attention + MoE layers): max |logits - HF| = {logit_err:.2e}, "
          f"max |grad - HF| = {max(grad_err.values()):.2e}")
    assert logit_err <= 1e-4
    assert max(grad_err.values()) <= 1e-5, {n: e for n, e in grad_err.items() if e > 1e-5}
