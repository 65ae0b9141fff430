"""fp32 gradient accumulation inside the weight-gradient GEMM, for Megatron's own (no-TE) linears.

Without it every linear's backward computes ``dW = dYᵀ·X`` into a fresh tensor and Megatron DDP's hook
adds it to the contiguous ``main_grad`` buffer: one extra elementwise kernel (and a ``dW``-sized
allocation) per weight per micro-batch. Megatron's ``gradient_accumulation_fusion`` instead calls
``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(X, dY, main_grad)`` (an Apex extension we cannot
install); :func:`install` provides that module in torch: ``main_grad.addmm_(dYᵀ, X)`` (one GEMM with
``beta=1``) when the dtypes agree, and on CUDA ``torch.addmm(..., out_dtype=float32, out=main_grad)`` for
bf16 activations into an fp32 buffer (cuBLAS accumulates in fp32 and adds in place; if this torch lacks
it, the first call falls back to GEMM + add for the rest of the process: the unfused cost, never wrong).

Megatron's backward then hands DDP a dummy ``dW`` (the hook skips the add: ``grad_added_to_main_grad``);
without TE it would allocate that dummy with ``device=torch.cuda.current_device()`` every call, so
:func:`install` also gives ``tensor_parallel.layers`` TE's ``get_dummy_wgrad`` contract (one cached
buffer per shape, on the weight's device; ``layers.HAVE_TE`` is read only there and by a CPU-offloading
assert, and offloading is off). Enabled with :mod:`megatron_rl.models.fused_layer` (``model.fused_elementwise``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, Tuple

import torch
from megatron.core.tensor_parallel import layers

CALLS = {"fused": 0, "fallback": 0}  # read by the tests: the fused path ran
_dummies: Dict[Tuple, torch.Tensor] = {}
_state = {"out_dtype_ok": True}


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def wgrad_gemm_accum(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_outputᵀ · total_input`` (2-D or ``[s, b, ·]``), accumulated in ``main_grad``'s dtype."""
    x, dy = _as_2d(total_input), _as_2d(grad_output)
    if x.dtype == main_grad.dtype:
        main_grad.addmm_(dy.t(), x)
        CALLS["fused"] += 1
        return
    if main_grad.is_cuda and _state["out_dtype_ok"]:
        try:
            torch.addmm(main_grad, dy.t(), x, out_dtype=main_grad.dtype, out=main_grad)
            CALLS["fused"] += 1
            return
        except (RuntimeError, TypeError, NotImplementedError):  # torch without addmm.dtype_out for these dtypes
            _state["out_dtype_ok"] = False
    main_grad.add_(dy.t().mm(x))
    CALLS["fallback"] += 1


def get_dummy_wgrad(shape, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
    """TE's contract: a reusable ``dW`` placeholder (Megatron DDP's hook discards it)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    key = (tuple(shape), dtype, device)
    if key not in _dummies:
        _dummies[key] = torch.empty(key[0], dtype=dtype, device=device)
    if zero:
        _dummies[key].zero_()
    return _dummies[key]


def install() -> None:
    """Make Megatron's linears able to run with ``gradient_accumulation_fusion=True`` (idempotent)."""
    if getattr(layers, "_megatron_rl_wgrad", False):
        return
    if not layers._grad_accum_fusion_available:  # Apex present: keep its kernel
        layers.fused_weight_gradient_mlp_cuda = SimpleNamespace(
            wgrad_gemm_accum_fp32=wgrad_gemm_accum, wgrad_gemm_accum_fp16=wgrad_gemm_accum)
        layers._grad_accum_fusion_available = True
    if not layers.HAVE_TE:
        layers.get_dummy_wgrad = get_dummy_wgrad
        layers.HAVE_TE = True
    layers._megatron_rl_wgrad = True
