"""The fused local layer (model.fused_elementwise='on': RMSNorm, SwiGLU, RoPE, residual adds compiled, wgrad
accumulated into main_grad inside the GEMM) trains like the unfused one: same losses, grad norms, every gradient and the forward statistics, packed
under a token budget (fp32, gloo, one rank); and a batch of other packed lengths compiles nothing new.
Compiled with ``aot_eager`` (inductor needs a C++ compile per graph: tens of seconds on CI's cores)."""

from __future__ import annotations

import torch

from multiproc import run_distributed, tiny_hf_checkpoint

import train_helpers  # noqa: F401  (warning filters for the ranks)


def _child(path):
    import train_helpers as th
    from torch._dynamo.utils import counters

    from megatron_rl.models import fused_layer, fused_wgrad
    from megatron_rl.training import OptimConfig, TrainConfig

    fused_layer.BACKEND = "aot_eager"
    tc = TrainConfig(max_tokens_per_micro_batch=32, forward_max_tokens_per_micro_batch=48)
    optim = OptimConfig(lr=1e-3, clip_grad=0.0, use_distributed_optimizer=False)
    batch = th.make_batch(8, seed=0)
    out = {mode: th.train_run(path, {}, batch, tc, optim, steps=2, forward=True,
                              model_overrides={"fused_elementwise": mode}) for mode in ("off", "on")}
    graphs = counters["stats"]["unique_graphs"]
    out["wgrad_calls"] = dict(fused_wgrad.CALLS)
    other = th.make_batch(8, seed=3, max_prompt=9, max_response=14)  # other lengths, other packing
    th.train_run(path, {}, other, tc, optim, steps=1, grads=False, model_overrides={"fused_elementwise": "on"})
    out["new_graphs"] = counters["stats"]["unique_graphs"] - graphs
    out["graphs"] = graphs
    return out


def test_fused_layer_trains_like_the_unfused_one(tmp_path):
    path = tiny_hf_checkpoint(str(tmp_path / "qwen3"), "qwen3")
    out = run_distributed(_child, 1, path, timeout_s=600)[0]
    off, on = out["off"], out["on"]
    assert out["graphs"] >= 5 and out["new_graphs"] == 0, (out["graphs"], out["new_graphs"])
    # every linear's wgrad went straight into main_grad: 2 steps x micro-batches x 2 layers x 4 linears
    assert out["wgrad_calls"]["fused"] >= 2 * 2 * 2 * 4 and out["wgrad_calls"]["fallback"] == 0, out["wgrad_calls"]
    # step 2 follows an lr 1e-3 Adam step from fp32 gradients equal to ~1e-7: relative to step 1's loss
    scale = abs(off["losses"][0])
    for a, b in zip(on["losses"], off["losses"]):
        assert abs(a - b) <= 1e-6 * scale, (on["losses"], off["losses"])
    for a, b in zip(on["grad_norms"], off["grad_norms"]):
        assert abs(a - b) <= 1e-5 * abs(b), (on["grad_norms"], off["grad_norms"])
    assert on["grads"].keys() == off["grads"].keys()
    for name, g in off["grads"].items():
        err = (on["grads"][name] - g).abs().max()
        assert err <= 1e-5 * max(g.abs().max(), 1e-12), (name, float(err))
    for key, v in off["forward"].items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            torch.testing.assert_close(on["forward"][key], v, rtol=1e-5, atol=1e-6, msg=key)
