"""GPU check section ``gdn`` (not in the default list: ``python tools/gpu_check.py --sections gdn``): one
Gated-DeltaNet layer of a Qwen3-Next-style hybrid, Megatron-Core's ``GatedDeltaNet`` (Transformer Engine spec,
fla kernels) loaded through :func:`megatron_rl.models.qwen3_next.hf_to_megatron` == HF's
``Qwen3NextGatedDeltaNet`` in float32 (output and the input's gradient).

It checks on CUDA what the CPU cannot build (megatron_rl/models/qwen3_next.py says why): the fused ``in_proj``
order ``[q | k | v | z | b | a]``, the conv / ``dt_bias`` / ``A_log`` layout, and the assumption that Megatron's
zero-centred ``out_norm`` holds HF's gated-norm weight minus 1. Needs ``pip install flash-linear-attention``
and transformer-engine. Not yet run: no GPU was lent to the session that wrote it.
"""

from __future__ import annotations

import torch

TINY = dict(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=32,
            linear_value_head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
            layer_types=["linear_attention"])


def section_gdn(ctx) -> dict:
    if ctx.cpu:
        raise RuntimeError("gdn needs CUDA: Megatron-Core's GatedDeltaNet allocates on torch.cuda.current_device() "
                           "and needs flash-linear-attention's Triton kernels (megatron_rl/models/qwen3_next.py)")
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_gated_delta_net_module_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from megatron_rl.models import qwen3_next

    ctx.init_megatron()
    hf_cfg = Qwen3NextConfig(**TINY)
    torch.manual_seed(0)
    hf = Qwen3NextForCausalLM(hf_cfg).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.1)
    layer = hf.model.layers[0].to(ctx.device)
    arch = qwen3_next.hf_fields(hf_cfg)
    tconfig = TransformerConfig(num_layers=1, hidden_size=arch.hidden_size, num_attention_heads=arch.num_heads,
                                num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim,
                                normalization="RMSNorm", layernorm_epsilon=hf_cfg.rms_norm_eps,
                                activation_func=torch.nn.functional.silu, params_dtype=torch.float32,
                                hidden_dropout=0.0, attention_dropout=0.0,
                                **{k: v for k, v in qwen3_next.transformer_kwargs(arch).items()
                                   if not k.startswith("moe_")})
    gdn = build_module(get_gated_delta_net_module_spec(tconfig), config=tconfig, layer_number=1,
                       pg_collection=ProcessGroupCollection.use_mpu_process_groups()).to(ctx.device)
    sd = {k: v for k, v in hf.state_dict().items() if k.startswith("model.layers.0.linear_attn.")}
    meg = {k.removeprefix("decoder.layers.0.self_attention."): v for k, v in qwen3_next.hf_to_megatron(arch, sd).items()
           if k.startswith("decoder.layers.0.self_attention.")}
    meg["in_proj.layer_norm_weight"] = torch.zeros(arch.hidden_size)  # TE fuses the input norm; zero-centred: 1
    missing, unexpected = gdn.load_state_dict(meg, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"GatedDeltaNet state dict: missing {missing}, unexpected {unexpected}")

    B, S, H = 2, 128, arch.hidden_size
    x = torch.randn(S, B, H, device=ctx.device, requires_grad=True)
    x_hf = x.detach().clone().transpose(0, 1).requires_grad_(True)
    normed = x_hf * torch.rsqrt(x_hf.pow(2).mean(-1, keepdim=True) + hf_cfg.rms_norm_eps)  # HF's input norm, w = 1
    ref = layer.linear_attn(hidden_states=normed)
    out, bias = gdn(x, attention_mask=None)
    out = out + bias if bias is not None else out
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g.transpose(0, 1))
    diff = (out.transpose(0, 1) - ref).abs().max().item()
    grad_diff = (x.grad.transpose(0, 1) - x_hf.grad).abs().max().item()
    return {"batch": [B, S], "hidden": H, "max_abs_out_diff": diff, "max_abs_input_grad_diff": grad_diff,
            "ok": diff <= 1e-3 and grad_diff <= 1e-3}


FUNCS = {"gdn": section_gdn}
