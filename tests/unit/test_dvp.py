"""DVP safe-set rules, pruned log-probs and the out-of-set policy, single process (math_spec §b.5)."""

import math

import pytest
import torch

from megatron_rl.objectives import (
    DVPConfig, LossInputs, ObjectiveConfig, PolicyLossConfig, pruned_token_stats, rl_loss,
)
from megatron_rl.ops import vocab_parallel_stats
from dvp_reference import ref_keep, ref_pruned
from ops_reference import pad_vocab

f64 = torch.float64
RULES = [("min_p", 0.05), ("top_k", 4), ("top_p", 0.8), ("abs_logprob", -3.0)]


def _cfg(rule, param):
    field = {"min_p": "min_p", "top_k": "top_k", "top_p": "top_p", "abs_logprob": "abs_logprob"}[rule]
    return DVPConfig(enabled=True, rule=rule, **{field: param})


def _logits(seed, rows=24, V=29, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, V, generator=g, dtype=f64) * scale
    t = torch.randint(0, V, (rows,), generator=g)
    t[:4] = z[:4].argmin(-1)  # some targets surely outside K ...
    t[4:8] = z[4:8].argmax(-1)  # ... and some surely inside
    return z, t


@pytest.mark.parametrize("rule,param", RULES)
@pytest.mark.parametrize("temperature,chunk", [(1.0, None), (0.7, 5)])
def test_rules_match_float64_reference(rule, param, temperature, chunk):
    z, t = _logits(0)
    x = pad_vocab(z, 4, fill=100.0).requires_grad_()  # junk padding must never count
    st = pruned_token_stats(x, t, _cfg(rule, param), vocab_size=29, temperature=temperature, chunk_size=chunk)
    xr = z.clone().requires_grad_()
    ref = ref_pruned(xr, t, 29, rule, param, temperature)
    torch.testing.assert_close(st.logprobs, ref["logprobs"].detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(st.kept_mass, ref["kept_mass"], atol=1e-12, rtol=1e-12)
    assert torch.equal(st.target_kept, ref["target_kept"])
    assert (~st.target_kept).any() and st.target_kept.any() and (st.kept_mass < 1).all()
    w = torch.randn(t.shape, dtype=f64, generator=torch.Generator().manual_seed(1))
    (g,) = torch.autograd.grad((st.logprobs * w).sum(), x)
    (g_ref,) = torch.autograd.grad((ref["logprobs"] * w).sum(), xr)
    torch.testing.assert_close(g[:, :29], g_ref, atol=1e-12, rtol=1e-10)
    assert torch.all(g[:, 29:] == 0)
    # pruned columns (outside K ∪ {y}) get exactly zero gradient (b.5.4)
    keep = ref_keep(z / temperature, rule, param)
    keep[torch.arange(len(t)), t] = True
    assert torch.all(g[:, :29][~keep] == 0) and (g[:, :29][keep] != 0).any()


def test_top_k_keeps_exactly_k_and_ties():
    z = torch.tensor([[3.0, 1.0, 2.0, 2.0, -1.0], [0.0, 0.0, 0.0, 5.0, 1.0]], dtype=f64)
    t = torch.tensor([4, 1])
    st = pruned_token_stats(z, t, DVPConfig(enabled=True, rule="top_k", top_k=2))
    # row 0: {3, 2, 2} (tie at the k-th value kept); row 1: {5, 1}
    p0 = torch.softmax(z[0], 0)
    assert st.kept_mass[0].item() == pytest.approx((p0[0] + p0[2] + p0[3]).item())
    assert st.target_kept.tolist() == [False, False]
    big = pruned_token_stats(z, t, DVPConfig(enabled=True, rule="top_k", top_k=50))  # k > V keeps everything
    torch.testing.assert_close(big.logprobs, torch.log_softmax(z, -1).gather(-1, t[:, None]).squeeze(-1))


def test_pruned_policy_identities():
    """b.5.1-3: π_K sums to 1 on K; log π_K = log π − log Z_K on K; TV(π, π_K) = 1 − Z_K; min-p from
    probabilities ≡ from logits; min_p → 0 reproduces log-softmax."""
    z, _ = _logits(2, rows=6, V=17)
    V = 17
    cfg = DVPConfig(enabled=True, min_p=0.1)
    lp_full = torch.log_softmax(z, -1)
    keep = ref_keep(z, "min_p", 0.1)
    assert torch.equal(keep, z >= z.amax(-1, keepdim=True) + math.log(0.1))
    pk = torch.zeros_like(z)
    for v in range(V):  # π_K(v) for every v in K via the op, one target column at a time
        st = pruned_token_stats(z, torch.full((6,), v), cfg)
        inside = st.target_kept
        pk[:, v] = torch.where(inside, st.logprobs.exp(), torch.zeros(()))
        torch.testing.assert_close(st.logprobs[inside], (lp_full[:, v] - st.kept_mass.log())[inside])
    torch.testing.assert_close(pk.sum(-1), torch.ones(6, dtype=f64))
    tv = 0.5 * (lp_full.exp() - pk).abs().sum(-1)
    torch.testing.assert_close(tv, 1 - st.kept_mass)
    zero = pruned_token_stats(z, torch.arange(6), DVPConfig(enabled=True, min_p=0.0))
    torch.testing.assert_close(zero.logprobs, lp_full.gather(-1, torch.arange(6)[:, None]).squeeze(-1))
    assert torch.all(zero.kept_mass == 1)


def test_min_p_agrees_with_the_ops_fused_path():
    z, t = _logits(3)
    for dt in (f64, torch.float32):
        x = pad_vocab(z, 4).to(dt)
        mine = pruned_token_stats(x, t, DVPConfig(enabled=True, min_p=0.05), vocab_size=29, temperature=1.3)
        ops = vocab_parallel_stats(x, t, vocab_size=29, temperature=1.3, min_p=0.05)
        tol = 1e-12 if dt == f64 else 1e-5
        torch.testing.assert_close(mine.logprobs.double(), ops.pruned_logprobs.double(), atol=tol, rtol=tol)
        torch.testing.assert_close(mine.kept_mass.double(), ops.kept_mass.double(), atol=tol, rtol=tol)
        assert torch.equal(mine.target_kept, ops.target_kept)


def test_bf16_logits_give_fp32_outputs_and_bf16_grads():
    z, t = _logits(4)
    x = z.to(torch.bfloat16).requires_grad_()
    st = pruned_token_stats(x, t, DVPConfig(enabled=True, rule="top_p", top_p=0.9))
    assert st.logprobs.dtype == torch.float32
    st.logprobs.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad.float()).all()


def test_mismatch_bound_exact_form():
    """b.5.6 / check 6: |Δ_a| <= (1 − p_a)(e^{2ε} − 1) for logit perturbations |ε_v| <= ε; the first-order
    form 2ε(1 − p) is exceeded by the adversarial two-token case."""
    g = torch.Generator().manual_seed(5)
    eps = 0.05
    z = torch.randn(4000, 8, generator=g, dtype=f64) * 3
    pert = (torch.rand(4000, 8, generator=g, dtype=f64) * 2 - 1) * eps
    t = torch.randint(0, 8, (4000,), generator=g)
    a = vocab_parallel_stats(z, t).logprobs.double()
    b = vocab_parallel_stats(z + pert, t).logprobs.double()
    p = a.exp()
    assert ((b - a).abs() <= (1 - p) * math.expm1(2 * eps) + 1e-12).all()
    adv = abs(-eps - math.log(0.5 * math.exp(-eps) + 0.5 * math.exp(eps)))
    assert adv > 2 * eps * 0.5 and adv <= 0.5 * math.expm1(2 * eps)


@pytest.mark.parametrize("policy", ["force_include", "mask"])
def test_out_of_set_policy(policy):
    B, T = 2, 3
    lp = torch.full((B, T), -1.0, dtype=f64)
    target_kept = torch.tensor([[True, False, True], [True, True, True]])
    inp = LossInputs(lp.clone().requires_grad_(), torch.ones(B, T, dtype=torch.bool), torch.ones(B, T, dtype=f64),
                     old_logprobs=lp, rollout_logprobs=lp, kept_mass=torch.full((B, T), 0.9, dtype=f64),
                     target_kept=target_kept)
    cfg = ObjectiveConfig(policy=PolicyLossConfig("reinforce"), dvp=DVPConfig(enabled=True, out_of_set=policy))
    loss, m = rl_loss(inp, cfg)
    assert m["dvp/target_outside_frac"].item() == pytest.approx(1 / 6)
    assert m["dvp/pruned_mass"].item() == pytest.approx(0.1) and m["dvp/kept_mass"].item() == pytest.approx(0.9)
    assert m["dvp/pruned_mass_per_seq"].item() == pytest.approx(0.3)
    kept_tokens = 5 if policy == "mask" else 6
    assert m["tokens/kept"].item() == kept_tokens
    assert loss.item() == pytest.approx(kept_tokens / 6)  # −A·log π = +1 per token, total denominator
    with pytest.raises(ValueError, match="target_kept"):
        rl_loss(LossInputs(lp.clone(), torch.ones(B, T, dtype=torch.bool), torch.ones(B, T, dtype=f64),
                           old_logprobs=lp), ObjectiveConfig(dvp=DVPConfig(enabled=True, out_of_set="mask")))
