"""Single-process checks of the vocab-parallel ops against float64 references (math_spec §1.2, b, c, d)."""

import pytest
import torch

from megatron_rl.ops import vocab_parallel_kl, vocab_parallel_stats
from ops_reference import ref_kl, ref_stats

# fp32 statistics vs float64: log-softmax rounding of O(1e-7) relative, amplified by |z| ~ 10.
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-5}
GRAD_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _weights(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _check_stats(logits, targets, vocab_size, temperature, min_p, chunk):
    x = logits.clone().requires_grad_()
    st = vocab_parallel_stats(x, targets, vocab_size=vocab_size, temperature=temperature, min_p=min_p,
                              chunk_size=chunk)
    xd = logits.detach().double().requires_grad_()
    ref = ref_stats(xd, targets, vocab_size, temperature, min_p)
    dt = logits.dtype
    fields = ["logprobs", "entropy", "sum_pi_squared"] + (["pruned_logprobs", "kept_mass"] if min_p is not None else [])
    for k in fields:
        torch.testing.assert_close(getattr(st, k).double(), ref[k].detach(), atol=TOL[dt], rtol=TOL[dt], msg=k)
    if min_p is not None:
        assert torch.equal(st.target_kept, ref["target_kept"])
    w = [_weights(targets.shape, i) for i in range(3)]
    diff_fields = ["logprobs", "entropy"] + (["pruned_logprobs"] if min_p is not None else [])
    loss = sum((getattr(st, k).double() * w[i]).sum() for i, k in enumerate(diff_fields))
    loss_ref = sum((ref[k] * w[i]).sum() for i, k in enumerate(diff_fields))
    (g,) = torch.autograd.grad(loss, x)
    (g_ref,) = torch.autograd.grad(loss_ref, xd)
    assert g.dtype == logits.dtype
    torch.testing.assert_close(g.double(), g_ref, atol=GRAD_TOL[dt], rtol=GRAD_TOL[dt])
    assert torch.all(g[..., vocab_size:] == 0), "padding columns must get exactly zero gradient"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,min_p,chunk", [(1.0, None, None), (0.7, None, 3), (1.3, 0.02, 5), (1.0, 0.3, 1)])
def test_stats_match_float64_reference(dtype, temperature, min_p, chunk):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 11, 203, generator=g) * 4).to(dtype)  # leading dims [B, T] are kept
    targets = torch.randint(0, 197, (3, 11), generator=g)
    _check_stats(logits, targets, 197, temperature, min_p, chunk)


def test_extreme_logits_and_neg_inf_blocks():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 300, generator=g, dtype=torch.float64) * 3
    logits[0, :] = 0.0
    logits[1, 7] = 1e4  # one dominating logit
    logits[2, :] = -1e4
    logits[2, 5] = 1e4
    logits[3, 100:200] = -torch.inf  # a whole block (a TP shard's worth) at -inf
    logits[4, :150] = -torch.inf
    targets = torch.randint(0, 300, (16,), generator=g)
    targets[3] = 42
    targets[4] = 151
    for dt in (torch.float64, torch.float32):
        _check_stats(logits.to(dt), targets, 300, 1.0, None, 4)
        _check_stats(logits.to(dt), targets, 300, 1.0, 0.1, 4)
    st = vocab_parallel_stats(logits.float(), targets)
    assert torch.isfinite(st.logprobs[[0, 1, 2, 3, 4]]).all() and torch.isfinite(st.entropy).all()
    # A target whose logit is -inf has log-prob -inf (exactly), not NaN.
    t = targets.clone()
    t[3] = 150
    assert vocab_parallel_stats(logits.float(), t).logprobs[3].item() == -torch.inf


def test_min_p_zero_reproduces_full_log_softmax():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(50, 128, generator=g) * 5
    targets = torch.randint(0, 120, (50,), generator=g)
    st = vocab_parallel_stats(logits, targets, vocab_size=120, min_p=0.0)
    assert torch.equal(st.pruned_logprobs, st.logprobs)
    torch.testing.assert_close(st.kept_mass, torch.ones(50), atol=0, rtol=0)
    assert st.target_kept.all()
    tiny = vocab_parallel_stats(logits, targets, vocab_size=120, min_p=1e-30)
    assert torch.equal(tiny.pruned_logprobs, st.logprobs)


def test_pruned_columns_get_exactly_zero_gradient():
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(20, 64, generator=g) * 3).requires_grad_()
    targets = logits.detach().argmax(-1)
    targets[::4] = logits.detach().argmin(-1)[::4]  # sampled tokens outside K: force-included
    st = vocab_parallel_stats(logits, targets, min_p=0.1)
    st.pruned_logprobs.sum().backward()
    p = torch.softmax(logits.detach(), -1)
    keep = p >= 0.1 * p.amax(-1, keepdim=True)
    keep[torch.arange(20), targets] = True
    assert torch.all(logits.grad[~keep] == 0)
    multi = keep.sum(-1) > 1  # a kept set of one token has log pi_K(y) = 0 and zero gradient
    assert torch.all(logits.grad[multi][keep[multi]] != 0)
    assert torch.all(logits.grad[~multi] == 0)
    torch.testing.assert_close(logits.grad.sum(-1), torch.zeros(20), atol=1e-6, rtol=0)
    assert not st.target_kept[::4].any() and st.target_kept[1::4].all()
    # The pruned policy sums to one over K' and the bias metric is the pruned mass (math_spec b.3).
    pk = torch.exp(torch.log_softmax(logits.detach().masked_fill(~keep, -torch.inf), -1))
    torch.testing.assert_close(pk.sum(-1), torch.ones(20))
    assert torch.all(st.kept_mass <= 1) and torch.all(st.kept_mass > 0)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_kl_matches_float64_autograd(direction, dtype):
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(2, 9, 150, generator=g) * 3).to(dtype)
    ref_logits = (torch.randn(2, 9, 150, generator=g) * 3).to(dtype)
    x = logits.clone().requires_grad_()
    kl, tv = vocab_parallel_kl(x, ref_logits, vocab_size=141, direction=direction, temperature=0.8, chunk_size=4,
                               with_tv=True)
    xd = logits.double().requires_grad_()
    kl_ref, tv_ref = ref_kl(xd, ref_logits, 141, direction, 0.8)
    torch.testing.assert_close(kl.double(), kl_ref.detach(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(tv.double(), tv_ref.detach(), atol=TOL[dtype], rtol=TOL[dtype])
    w = _weights(kl.shape, 5)
    (gk,) = torch.autograd.grad((kl.double() * w).sum(), x)
    (gk_ref,) = torch.autograd.grad((kl_ref * w).sum(), xd)
    torch.testing.assert_close(gk.double(), gk_ref, atol=GRAD_TOL[dtype], rtol=GRAD_TOL[dtype])
    assert torch.all(gk[..., 141:] == 0)
    # Closed forms sum to zero over the vocabulary (softmax shift invariance, math_spec c.3).
    torch.testing.assert_close(gk.double().sum(-1), torch.zeros_like(w), atol=100 * GRAD_TOL[dtype], rtol=0)


def test_kl_zero_iff_shifted_copy():
    g = torch.Generator().manual_seed(6)
    ref_logits = torch.randn(7, 40, generator=g, dtype=torch.float64)
    x = (ref_logits + 3.5).requires_grad_()  # same policy, shifted logits
    for direction in ("reverse", "forward"):
        kl = vocab_parallel_kl(x, ref_logits, direction=direction)
        assert kl.abs().max() < 1e-12
        (gk,) = torch.autograd.grad(kl.sum(), x)
        assert gk.abs().max() < 1e-12
    other = vocab_parallel_kl(x, ref_logits + torch.randn(7, 40, generator=g, dtype=torch.float64))
    assert torch.all(other > 1e-6)


def test_inputs_are_not_modified():
    g = torch.Generator().manual_seed(7)
    for dt, temp in [(torch.float32, 1.0), (torch.float32, 0.5), (torch.bfloat16, 1.0)]:
        logits = (torch.randn(10, 80, generator=g) * 2).to(dt)
        ref_logits = torch.randn(10, 80, generator=g).to(dt)
        targets = torch.randint(0, 80, (10,), generator=g)
        before, before_ref, before_t = logits.clone(), ref_logits.clone(), targets.clone()
        x = logits.requires_grad_()
        st = vocab_parallel_stats(x, targets, temperature=temp, min_p=0.05, chunk_size=3)
        kl = vocab_parallel_kl(x, ref_logits, temperature=temp, chunk_size=3)
        (st.logprobs.sum() + st.entropy.sum() + st.pruned_logprobs.sum() + kl.sum()).backward()
        assert torch.equal(logits.detach(), before) and torch.equal(ref_logits, before_ref)
        assert torch.equal(targets, before_t)


def test_chunking_gives_identical_results():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(33, 500, generator=g)
    targets = torch.randint(0, 500, (33,), generator=g)
    a = vocab_parallel_stats(logits, targets, chunk_size=1)
    b = vocab_parallel_stats(logits, targets, chunk_size=64)
    assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.entropy, b.entropy)


def test_entropy_of_uniform_and_one_hot():
    v = 64
    st = vocab_parallel_stats(torch.zeros(2, v), torch.tensor([0, 5]))
    torch.testing.assert_close(st.entropy, torch.full((2,), torch.log(torch.tensor(float(v)))))
    torch.testing.assert_close(st.sum_pi_squared, torch.full((2,), 1.0 / v))
    hot = torch.full((1, v), -1e4)
    hot[0, 3] = 1e4
    st = vocab_parallel_stats(hot, torch.tensor([3]))
    assert st.entropy.item() == 0.0 and st.logprobs.item() == 0.0 and st.sum_pi_squared.item() == 1.0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(logits=torch.zeros(4, 10, dtype=torch.int64)), "logits: expected a floating-point"),
        (dict(targets=torch.zeros(5, dtype=torch.int64)), r"targets: shape \(5,\) must equal"),
        (dict(targets=torch.tensor([0, 1, 2, 10])), r"targets: ids must lie in \[0, vocab_size=10\)"),
        (dict(targets=torch.tensor([0, 1, 2, -1])), "got min -1"),
        (dict(targets=torch.zeros(4)), "targets: expected an int64"),
        (dict(vocab_size=11), "vocab_size=11 is inconsistent"),
        (dict(temperature=0.0), "temperature: must be"),
        (dict(min_p=1.5), "min_p: must lie in"),
        (dict(chunk_size=0), "chunk_size: must be"),
    ],
)
def test_bad_input_raises_value_error(kwargs, match):
    args = dict(logits=torch.zeros(4, 10), targets=torch.tensor([0, 1, 2, 3]))
    args.update(kwargs)
    logits, targets = args.pop("logits"), args.pop("targets")
    with pytest.raises(ValueError, match=match):
        vocab_parallel_stats(logits, targets, **args)


def test_kl_bad_input():
    with pytest.raises(ValueError, match="ref_logits: shape"):
        vocab_parallel_kl(torch.zeros(4, 10), torch.zeros(4, 11))
    with pytest.raises(ValueError, match="direction: expected one of"):
        vocab_parallel_kl(torch.zeros(4, 10), torch.zeros(4, 10), direction="sideways")
