"""Fused elementwise work of the local (no-TE) layer: RMSNorm (float32 math), SwiGLU, RoPE, residual adds.

Each is one ``torch.compile``'d function (inductor on CUDA: one kernel forward, one or two backward, in
place of the ~8 launches of an unfused RMSNorm, ~4 of SwiGLU and ~7 of RoPE). The math is the unfused
path's, op for op, so values and gradients match it (tests/unit/test_fused_layer.py, float64).

* ``dynamic=True``: packed micro-batches change length every step; every dimension is symbolic from the
  first call, so a new length never recompiles (the test counts compilations over varying lengths). A
  function compiles once per input rank / dtype / grad mode, a handful per process.
* Chosen by ``model.fused_elementwise`` (:class:`megatron_rl.models.config.ModelConfig`): ``auto`` = on
  with CUDA, off on CPU (no launch cost to save there, and inductor's C++ compile costs tens of seconds per
  function on a shared 2-core box), ``on`` / ``off`` force it.
* RoPE is applied inside Megatron's attention through ``rope_utils._apply_rotary_pos_emb_bshd`` (the
  vectorised packed RoPE of :mod:`megatron_rl.compat` calls it too): :func:`install_rope` swaps in a
  dispatcher, process-wide, set by the last model built (a process trains on one device).
* Dropout inside a compiled graph draws from inductor's RNG, not Megatron's: residual adds with hidden
  dropout > 0 in training stay on the eager path.

``BACKEND`` is ``"inductor"``; tests set ``"aot_eager"`` (same graphs and autograd, no C++ compiler). A
function whose compilation fails (no working Triton or C++ compiler) warns once and runs unfused.
"""

from __future__ import annotations

import logging
import warnings
from typing import Callable, Dict, Set, Tuple

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer.mlp import MLP

MODES = ("auto", "on", "off")
BACKEND = "inductor"
_compiled: Dict[Tuple[Callable, object], Callable] = {}
_failed: Set[Tuple[Callable, object]] = set()
_COMPILE_ERRORS = (torch._dynamo.exc.BackendCompilerFailed, torch._dynamo.exc.Unsupported,
                   torch._dynamo.exc.InternalTorchDynamoError)


def resolve(mode: str, cuda: bool) -> bool:
    """``model.fused_elementwise`` -> on/off for a model on CUDA (``cuda``) or the CPU."""
    if mode not in MODES:
        raise ValueError(f"model.fused_elementwise={mode!r}: expected one of {MODES} (auto: on with CUDA)")
    return cuda if mode == "auto" else mode == "on"


def compiled(fn: Callable) -> Callable:
    """``fn`` compiled once per process and backend, all dimensions dynamic; run eagerly (the same math)
    while a Python torch-function or dispatch mode is active (the tests' device guard, bench op counters),
    which Dynamo would trace into or refuse."""
    key = (fn, BACKEND)
    if key not in _compiled:
        graph = torch.compile(fn, dynamic=True, fullgraph=True, backend=BACKEND)

        def call(*args, **kwargs):
            if (key in _failed or torch._C._len_torch_function_stack()
                    or torch._C._len_torch_dispatch_stack()):
                return fn(*args, **kwargs)
            try:
                return graph(*args, **kwargs)
            except _COMPILE_ERRORS as e:  # e.g. no working Triton / C++ compiler: the same math, unfused
                _failed.add(key)
                cause = getattr(e, "inner_exception", None) or e.__cause__ or e
                why = (str(cause).strip().splitlines() or [""])[0][:200]
                warnings.warn(f"models.fused_layer: torch.compile of {fn.__name__} failed ({type(cause).__name__}: "
                              f"{why}); running it unfused (set model.fused_elementwise=off to silence)",
                              RuntimeWarning, stacklevel=2)
                return fn(*args, **kwargs)

        _compiled[key] = call
    return _compiled[key]


# ---------------------------------------------------------------------------------------------------
# The fused functions (the unfused path's math, op for op)
# ---------------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` in float32, cast back before the weight (HF order)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up


def bias_swiglu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return swiglu(x + bias)


def residual_add(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return residual.to(x.dtype) + x


def bias_residual_add(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return residual.to(x.dtype) + (x + bias)


# ---------------------------------------------------------------------------------------------------
# Modules and functions of the local layer spec (FusedRMSNorm: models/spec.py)
# ---------------------------------------------------------------------------------------------------


class _SubclassNotUnknown(logging.Filter):
    # TransformerLayer passes tp_group only to an MLP that *is* MLP and warns for a subclass, once per layer;
    # FusedMLP then takes the default TP group, the one pg_collection.tp is in this project.
    def filter(self, record: logging.LogRecord) -> bool:
        return "Unknown MLP type" not in record.getMessage()


logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_SubclassNotUnknown())


class FusedMLP(MLP):
    """Megatron's dense MLP with the (bias +) SwiGLU between the two linears fused; any other activation
    set-up (per-token scales, clamps, GLU offsets, non-gated or non-SiLU) takes Megatron's own path."""

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        c = self.config
        if (per_token_scale is not None or not c.gated_linear_unit or c.activation_func is not F.silu
                or c.activation_func_clamp_value is not None or c.glu_linear_offset != 0.0
                or c.use_te_activation_func or c.bias_activation_fusion):
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        x, bias = self.linear_fc1(hidden_states)
        x = compiled(swiglu)(x) if bias is None else compiled(bias_swiglu)(x, bias)
        return self.linear_fc2(x)


def fused_bias_dropout_add(training: bool, fused: bool) -> Callable:
    """Drop-in for Megatron's ``get_bias_dropout_add``: the residual add (and bias) fused when no dropout
    is drawn; with dropout in training, Megatron's own function (its RNG)."""
    eager = get_bias_dropout_add(training, fused)

    def bias_dropout_add(x_with_bias, residual, prob):
        if training and prob > 0.0:
            return eager(x_with_bias, residual, prob)
        x, bias = x_with_bias
        if bias is None:
            return compiled(residual_add)(x, residual)
        return compiled(bias_residual_add)(x, bias, residual)

    return bias_dropout_add


_rope_state = {"on": False, "eager": None}


def install_rope(on: bool) -> None:
    """Route Megatron's ``_apply_rotary_pos_emb_bshd`` (padded and, through :mod:`megatron_rl.compat`,
    packed RoPE) through the compiled copy of itself when ``on``; process-wide."""
    if _rope_state["eager"] is None:
        _rope_state["eager"] = rope_utils._apply_rotary_pos_emb_bshd
        rope_utils._apply_rotary_pos_emb_bshd = _rope_bshd
    _rope_state["on"] = bool(on)


def _rope_bshd(t, freqs, rotary_interleaved=False, mscale=1.0, **mla):
    # **mla: the MLA-interleave flag passes through under the caller's name (megatron-core 0.16
    # `multi_latent_attention`, >= 0.19 `mla_rotary_interleaved`)
    fn = _rope_state["eager"]
    if _rope_state["on"]:
        fn = compiled(fn)
    return fn(t, freqs, rotary_interleaved=rotary_interleaved, mscale=mscale, **mla)
