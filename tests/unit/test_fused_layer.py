"""The fused elementwise functions of the local layer (models/fused_layer.py) equal the unfused path
(values and input/weight gradients, float64), and compile once whatever the packed length (dynamic
shapes; counted). Compiled with ``aot_eager``: the graphs and autograd inductor gets, without a C++ compiler."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from megatron_rl.models import fused_layer

LENGTHS = (37, 64, 129)  # packed micro-batch lengths of consecutive steps


@pytest.fixture
def counter(monkeypatch):
    c = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(fused_layer, "BACKEND", c)
    yield c
    for key in [k for k in fused_layer._compiled if k[1] is c]:
        del fused_layer._compiled[key]


def _check(fused, eager, *shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]
    ys = [x.detach().clone().requires_grad_() for x in xs]
    out, ref = fused(*xs), eager(*ys)
    w = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for x, y in zip(xs, ys):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-12)


def _megatron_glu(x):  # megatron.core.transformer.mlp.MLP.forward's glu with SiLU, no clamp, offset 0
    x_glu, x_linear = torch.chunk(x, 2, dim=-1)
    return F.silu(x_glu) * (x_linear + 0.0)


def test_fused_functions_equal_unfused_and_compile_once(counter):
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_rl.models.spec import FusedRMSNorm, RMSNorm

    eager_rope = fused_layer._rope_state["eager"] or rope_utils._apply_rotary_pos_emb_bshd
    megatron_bda = get_bias_dropout_add(True, False)
    cfg = type("C", (), {"params_dtype": torch.float64, "sequence_parallel": False})()
    norm, fused_norm = RMSNorm(cfg, 24, eps=1e-6), FusedRMSNorm(cfg, 24, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 24, dtype=torch.float64))
        fused_norm.weight.copy_(norm.weight)
    fused_bda = fused_layer.fused_bias_dropout_add(True, False)
    for i, t in enumerate(LENGTHS):
        _check(fused_norm, norm, (t, 1, 24), seed=i)
        torch.testing.assert_close(fused_norm.weight.grad, norm.weight.grad, rtol=1e-12, atol=1e-12)
        _check(fused_layer.compiled(fused_layer.swiglu), _megatron_glu, (t, 1, 2 * 40), seed=i)
        _check(fused_layer.compiled(fused_layer.bias_swiglu), lambda x, b: _megatron_glu(x + b), (t, 1, 80), (80,))
        _check(lambda x, r: fused_bda((x, None), r, 0.0), lambda x, r: megatron_bda((x, None), r, 0.0),
               (t, 1, 24), (t, 1, 24), seed=i)
        _check(lambda x, b, r: fused_bda((x, b), r, 0.0), lambda x, b, r: megatron_bda((x, b), r, 0.0),
               (t, 1, 24), (24,), (t, 1, 24), seed=i)
        freqs = torch.rand(t, 1, 1, 16, dtype=torch.float64) * 6
        _check(lambda q: fused_layer.compiled(eager_rope)(q, freqs), lambda q: eager_rope(q, freqs),
               (t, 1, 4, 16), seed=i)
    # one graph per function (norm, swiglu, bias+swiglu, add, bias+add, rope) over three lengths: no recompile
    assert counter.frame_count == 6, counter.frame_count


def test_rope_dispatch_routes_through_the_compiled_copy(counter):
    from megatron.core.models.common.embeddings import rope_utils

    fused_layer.install_rope(True)
    try:
        q, freqs = torch.randn(9, 1, 2, 8, dtype=torch.float64), torch.rand(9, 1, 1, 8, dtype=torch.float64)
        out = rope_utils._apply_rotary_pos_emb_bshd(q, freqs)
        assert counter.frame_count == 1
        torch.testing.assert_close(out, fused_layer._rope_state["eager"](q, freqs), rtol=0, atol=0)
    finally:
        fused_layer.install_rope(False)
    rope_utils._apply_rotary_pos_emb_bshd(q, freqs)
    assert counter.frame_count == 1  # off: the eager function, nothing compiled


def test_fused_elementwise_is_chosen_by_device():
    from megatron_rl.models.config import ModelConfig

    assert fused_layer.resolve("auto", cuda=True) and not fused_layer.resolve("auto", cuda=False)
    assert fused_layer.resolve("on", cuda=False) and not fused_layer.resolve("off", cuda=True)
    with pytest.raises(ValueError, match="model.fused_elementwise='yes'.*'auto', 'on' or 'off'"):
        ModelConfig(hf_path="x", fused_elementwise="yes")


def test_wgrad_accumulates_into_main_grad_in_one_gemm():
    from megatron_rl.models import fused_wgrad

    g = torch.Generator().manual_seed(0)
    main = torch.zeros(5, 7, dtype=torch.float64)
    ref = main.clone()
    before = dict(fused_wgrad.CALLS)
    for t in (3, 11):  # two micro-batches, [s, b, ·] and 2-D
        x, dy = torch.randn(t, 1, 7, generator=g, dtype=torch.float64), torch.randn(t, 1, 5, generator=g,
                                                                                   dtype=torch.float64)
        fused_wgrad.wgrad_gemm_accum(x, dy, main)
        ref += dy[:, 0].t() @ x[:, 0]
    torch.testing.assert_close(main, ref, rtol=1e-12, atol=1e-12)
    assert fused_wgrad.CALLS["fused"] == before["fused"] + 2
    # bf16 activations into an fp32 buffer (CPU: GEMM + add, the same sum)
    x, dy = torch.randn(6, 7, generator=g).bfloat16(), torch.randn(6, 5, generator=g).bfloat16()
    main32 = torch.ones(5, 7)
    fused_wgrad.wgrad_gemm_accum(x, dy, main32)
    torch.testing.assert_close(main32, 1 + (dy.t() @ x).float(), rtol=0, atol=0)


def test_fused_functions_run_eagerly_under_a_torch_function_mode(counter):
    from torch.overrides import TorchFunctionMode

    class Passthrough(TorchFunctionMode):  # as the tests' device guard
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x, w = torch.randn(5, 1, 8, dtype=torch.float64), torch.rand(8, dtype=torch.float64)
    with Passthrough():
        out = fused_layer.compiled(fused_layer.rms_norm)(x, w, 1e-6)
    assert counter.frame_count == 0
    torch.testing.assert_close(out, fused_layer.rms_norm(x, w, 1e-6), rtol=0, atol=0)


def test_a_failed_compile_warns_once_and_runs_unfused(monkeypatch):
    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(fused_layer, "BACKEND", broken)
    x, w = torch.randn(5, 1, 8, dtype=torch.float64), torch.rand(8, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="torch.compile of rms_norm failed.*no compiler here"):
        out = fused_layer.compiled(fused_layer.rms_norm)(x, w, 1e-6)
    torch.testing.assert_close(out, fused_layer.rms_norm(x, w, 1e-6), rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fused_layer.compiled(fused_layer.rms_norm)(x, w, 1e-6)  # once: no second warning, no second compile
    fused_layer._compiled.pop((fused_layer.rms_norm, broken))
    fused_layer._failed.discard((fused_layer.rms_norm, broken))
