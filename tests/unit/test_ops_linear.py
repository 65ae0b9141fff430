"""Single-process checks of the fused output layer (``vocab_parallel_linear_stats`` / ``_kl``).

Values and both gradients against float64 references live in tests/distributed/test_ops_linear_tp.py
(TP 1/2/4); here: equality with the unfused ops on the same (16-bit) logits, the memory bound (no
tensor larger than one ``[block, V]`` logits block is ever created, forward or backward), no-grad
use, and input errors.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_rl.ops import (vocab_parallel_kl, vocab_parallel_linear_kl, vocab_parallel_linear_stats,
                             vocab_parallel_stats)
from ops_reference import ref_stats


def _inputs(dtype, T=30, H=16, V=203, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, T // 2, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.7).to(dtype)
    y = torch.randint(0, 197, (2, T // 2), generator=g)
    return h, w, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,min_p,chunk", [(1.0, None, None), (0.8, 0.05, 4), (1.2, 0.3, 1)])
def test_equals_unfused_ops_on_the_same_logits(dtype, temperature, min_p, chunk):
    h, w, y = _inputs(dtype)
    kw = dict(vocab_size=197, temperature=temperature, min_p=min_p, chunk_size=chunk)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    fused = vocab_parallel_linear_stats(h1, w1, y, **kw)
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    unfused = vocab_parallel_stats(h2 @ w2.T, y, **kw)
    fields = ["logprobs", "entropy"] + (["pruned_logprobs"] if min_p is not None else [])
    for k in fields + ["sum_pi_squared"] + (["kept_mass"] if min_p is not None else []):
        torch.testing.assert_close(getattr(fused, k), getattr(unfused, k), atol=2e-6, rtol=2e-6, msg=k)
    if min_p is not None:
        assert torch.equal(fused.target_kept, unfused.target_kept)
    wts = [torch.randn(y.shape, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    g1 = torch.autograd.grad(sum((getattr(fused, k) * wts[i]).sum() for i, k in enumerate(fields)), (h1, w1))
    g2 = torch.autograd.grad(sum((getattr(unfused, k) * wts[i]).sum() for i, k in enumerate(fields)), (h2, w2))
    # 16-bit: both round the logit gradient to bf16 before the matmuls; the fused op accumulates dW in fp32.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(g1, g2):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b.float(), atol=tol * b.float().abs().max().item(), rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_backward_tiles_match_unfused(dtype):
    """Backward tiles of 75 rows x 64 columns (budget 8 rows x 997 columns): 4 row blocks, 16 vocabulary
    slices, the last one 37 wide inside a 64-wide buffer row, targets in every slice, padding columns."""
    g = torch.Generator().manual_seed(3)
    T, H, V, vocab = 300, 12, 1000, 997
    h = torch.randn(T, H, generator=g).to(dtype)
    w = torch.randn(V, H, generator=g).to(dtype)
    y = torch.randint(0, vocab, (T,), generator=g)
    kw = dict(vocab_size=vocab, temperature=0.7, min_p=0.02)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    fused = vocab_parallel_linear_stats(h1, w1, y, chunk_size=8, **kw)
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    unfused = vocab_parallel_stats(h2 @ w2.T, y, **kw)
    wts = [torch.randn(T, generator=g) for _ in range(3)]
    fields = ("logprobs", "entropy", "pruned_logprobs")
    g1 = torch.autograd.grad(sum((getattr(fused, k) * wt).sum() for k, wt in zip(fields, wts)), (h1, w1))
    g2 = torch.autograd.grad(sum((getattr(unfused, k) * wt).sum() for k, wt in zip(fields, wts)), (h2, w2))
    tol = 1e-12 if dtype == torch.float64 else 2e-2
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a.float(), b.float(), atol=tol * b.float().abs().max().item(), rtol=tol)
    assert torch.equal(g1[1][vocab:], torch.zeros_like(g1[1][vocab:]))


def test_kl_equals_unfused_and_grads_flow_to_student_only():
    h, w, y = _inputs(torch.float64)
    hr, wr, _ = _inputs(torch.float64, H=16, seed=1)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    wr1 = wr.clone().requires_grad_()
    kl = vocab_parallel_linear_kl(h1, w1, hr, wr1, vocab_size=197, temperature=0.9, chunk_size=4)
    kl_ref = vocab_parallel_kl(h @ w.T, hr @ wr.T, vocab_size=197, temperature=0.9)
    torch.testing.assert_close(kl, kl_ref, atol=1e-12, rtol=1e-12)
    kl.sum().backward()
    assert wr1.grad is None and h1.grad is not None and w1.grad is not None


def test_matches_float64_reference_under_no_grad_with_rank3_hidden():
    h, w, y = _inputs(torch.float64)
    with torch.no_grad():
        st = vocab_parallel_linear_stats(h, w, y, vocab_size=197, chunk_size=3)
    ref = ref_stats(h @ w.T, y, 197)
    for k in ("logprobs", "entropy", "sum_pi_squared"):
        torch.testing.assert_close(getattr(st, k), ref[k], atol=1e-12, rtol=1e-12)
    assert st.logprobs.shape == y.shape


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op returns while active (forward and autograd backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("min_p", [None, 0.1])
def test_never_creates_more_than_one_logits_block(min_p):
    T, H, V, block = 512, 8, 1000, 16
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g, requires_grad=True)
    y = torch.randint(0, V, (T,), generator=g)
    mode = _LargestTensor()
    with mode:
        st = vocab_parallel_linear_stats(h, w, y, min_p=min_p, chunk_size=block)
        loss = st.logprobs.sum() + st.entropy.sum() + (0 if min_p is None else st.pruned_logprobs.sum())
        loss.backward()
    # the outputs dW [V, H] and dhidden [T, H] are smaller than one block here; the logits are T*V
    assert mode.largest <= block * V < T * V // 8, mode.largest
    assert h.grad is not None and w.grad is not None


@pytest.mark.parametrize("kwargs,match", [
    (dict(weight=torch.zeros(5, 3)), "weight: expected \\[V_local, H=4\\]"),
    (dict(weight=torch.zeros(5, 4, dtype=torch.float64)), "weight: dtype/device"),
    (dict(targets=torch.zeros(3, dtype=torch.long)), "targets: shape"),
    (dict(targets=torch.full((2,), 9)), "targets: ids must lie in"),
    (dict(vocab_size=6), "vocab_size=6 is inconsistent"),
    (dict(backend="cuda"), "backend: expected one of"),
    (dict(min_p=2.0), "min_p: must lie in"),
])
def test_bad_input_raises_value_error(kwargs, match):
    args = dict(hidden=torch.zeros(2, 4), weight=torch.zeros(5, 4), targets=torch.zeros(2, dtype=torch.long))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        vocab_parallel_linear_stats(args.pop("hidden"), args.pop("weight"), args.pop("targets"), **args)


def test_kl_bad_reference_shapes():
    h, w = torch.zeros(2, 4), torch.zeros(5, 4)
    with pytest.raises(ValueError, match="ref_hidden/ref_weight: shapes"):
        vocab_parallel_linear_kl(h, w, torch.zeros(3, 6), torch.zeros(5, 6))
    with pytest.raises(ValueError, match="ref_weight: expected"):
        vocab_parallel_linear_kl(h, w, torch.zeros(2, 6), torch.zeros(5, 4))


def test_16bit_backward_is_finite_whatever_the_memory_held():
    """The backward's tile buffer is zeroed: torch's CPU bf16 matmul reads an operand's row up to its stride, so a
    NaN bit pattern left in freed memory past a narrower slice gave NaN gradients in about 1 backward in 4."""
    for _ in range(48):
        junk = torch.full((64, 512), float("nan"), dtype=torch.bfloat16)  # freed memory the next buffer may reuse
        del junk
        h, w, y = _inputs(torch.bfloat16)
        h.requires_grad_(), w.requires_grad_()
        out = vocab_parallel_linear_stats(h, w, y, vocab_size=197)
        gh, gw = torch.autograd.grad(out.logprobs.sum() + out.entropy.sum(), (h, w))
        assert torch.isfinite(gh).all() and torch.isfinite(gw).all()
