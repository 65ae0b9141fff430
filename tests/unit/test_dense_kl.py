"""Dense imitation gradient, future-KL cost-to-go, KL penalties and the entropy bonus (math_spec §c.7)."""

import itertools
import math

import pytest
import torch

from megatron_rl.objectives import (
    AggregationConfig, DenseKLConfig, EntropyBonusConfig, KLPenaltyConfig, LossInputs, ObjectiveConfig,
    PolicyLossConfig, add_future_kl_cost, dense_kl_per_token, future_kl_cost_to_go, kl_in_reward, kl_per_token,
    rl_loss,
)
from megatron_rl.ops import vocab_parallel_stats

f64 = torch.float64


def _dense_loss_grad(direction, z, zr, mask, beta):
    x = z.clone().requires_grad_()
    kappa = dense_kl_per_token(x, zr, DenseKLConfig(beta=beta, direction=direction))
    lp = torch.zeros(mask.shape, dtype=f64, requires_grad=True)
    inp = LossInputs(lp, mask, torch.zeros_like(lp), old_logprobs=lp.detach(), ref_kl=kappa)
    loss, m = rl_loss(inp, ObjectiveConfig(policy=PolicyLossConfig("reinforce"), dense_kl=DenseKLConfig(beta=beta)))
    (g,) = torch.autograd.grad(loss, x)
    return loss, g, kappa.detach(), m


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_dense_gradient_is_the_closed_form(direction):
    """c.7.1: ∇_z = β·c·π ⊙ (log π − log p − κ) (reverse) or β·c·(π − p) (forward); sums to 0 per row."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 4, 11, generator=g, dtype=f64) * 2
    zr = torch.randn(3, 4, 11, generator=g, dtype=f64) * 2
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2, 2:] = False
    beta = 0.7
    loss, grad, kappa, m = _dense_loss_grad(direction, z, zr, mask, beta)
    pi, p = torch.softmax(z, -1), torch.softmax(zr, -1)
    ell = pi.log() - p.log()
    if direction == "reverse":
        kl = (pi * ell).sum(-1)
        closed = pi * (ell - kl[..., None])
    else:
        kl = (p * -ell).sum(-1)
        closed = pi - p
    torch.testing.assert_close(kappa, kl)
    c = beta / mask.sum().item()
    torch.testing.assert_close(grad, torch.where(mask[..., None], c * closed, 0.0), atol=1e-13, rtol=1e-10)
    torch.testing.assert_close(grad.sum(-1), torch.zeros(3, 4, dtype=f64), atol=1e-14, rtol=0)
    assert loss.item() == pytest.approx(beta * kl[mask].mean().item())
    assert m["loss/dense_kl"].item() == pytest.approx(kl[mask].mean().item())


def test_dense_kl_zero_iff_logits_equal_up_to_a_constant():
    """c.7.2."""
    z = torch.randn(2, 3, 9, dtype=f64, generator=torch.Generator().manual_seed(1))
    for direction in ("reverse", "forward"):
        _, grad, kappa, _ = _dense_loss_grad(direction, z, z + 3.5, torch.ones(2, 3, dtype=torch.bool), 1.0)
        assert kappa.abs().max() < 1e-12 and grad.abs().max() < 1e-14
        _, grad2, kappa2, _ = _dense_loss_grad(direction, z, z * 1.1, torch.ones(2, 3, dtype=torch.bool), 1.0)
        assert (kappa2 > 0).all() and grad2.abs().max() > 1e-4


def test_cost_to_go_is_an_exclusive_masked_suffix_sum():
    kl = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 10.0, 100.0, 1000.0]], dtype=f64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    c = future_kl_cost_to_go(kl, mask, beta=0.5)
    torch.testing.assert_close(c, torch.tensor([[2.5, 1.5, 0.0, 0.0], [550.0, 0.0, 500.0, 0.0]], dtype=f64))
    adv = torch.ones_like(kl)
    torch.testing.assert_close(add_future_kl_cost(adv, kl, mask, DenseKLConfig(beta=0.5)), adv - c)
    off = DenseKLConfig(beta=0.5, sparse_includes_future_kl=False)
    assert add_future_kl_cost(adv, kl, mask, off) is adv


def test_dense_plus_sparse_equals_exact_gradient_on_enumerable_lm():
    """c.7.4 / check 11: on a 2-step tabular LM, −∇[Σ_τ P(τ)(−A_t log π + β κ_t)] with
    A_t = R − β Σ_{t'>t} κ_{t'} equals ∇J, J = E_P[R] − β KL(P_θ ‖ P_ref)."""
    V, beta = 3, 0.7
    g = torch.Generator().manual_seed(2)
    a = torch.randn(V, generator=g, dtype=f64, requires_grad=True)
    B2 = torch.randn(V, V, generator=g, dtype=f64, requires_grad=True)
    r1, r2 = torch.randn(V, generator=g, dtype=f64), torch.randn(V, V, generator=g, dtype=f64)
    R = torch.rand(V, V, generator=g, dtype=f64)
    ys = torch.tensor(list(itertools.product(range(V), range(V))))
    logits = torch.stack([a.expand(len(ys), V), B2[ys[:, 0]]], 1)  # [9, 2, V]
    ref = torch.stack([r1.expand(len(ys), V), r2[ys[:, 0]]], 1)
    lp = vocab_parallel_stats(logits, ys).logprobs.double()
    kappa = dense_kl_per_token(logits, ref, DenseKLConfig(beta=beta))
    mask = torch.ones(len(ys), 2, dtype=torch.bool)
    P = lp.sum(-1).exp().detach()
    adv = add_future_kl_cost(R[ys[:, 0], ys[:, 1]][:, None].expand(-1, 2), kappa.detach(), mask, DenseKLConfig(beta=beta))
    surrogate = (P[:, None] * (-adv * lp + beta * kappa)).sum()
    g_surr = torch.autograd.grad(surrogate, (a, B2), retain_graph=True)

    lref = torch.log_softmax(ref, -1).gather(-1, ys[..., None]).squeeze(-1).sum(-1)
    lpol = torch.log_softmax(logits, -1).gather(-1, ys[..., None]).squeeze(-1).sum(-1)
    J = (lpol.exp() * (R[ys[:, 0], ys[:, 1]] - beta * (lpol - lref))).sum()
    g_exact = torch.autograd.grad(J, (a, B2))
    for gs, ge in zip(g_surr, g_exact):
        torch.testing.assert_close(-gs, ge, atol=1e-12, rtol=1e-10)
    # dropping the cost-to-go changes the gradient (the flag matters)
    adv0 = R[ys[:, 0], ys[:, 1]][:, None].expand(-1, 2)
    g0 = torch.autograd.grad((P[:, None] * (-adv0 * lp + beta * kappa)).sum(), a)[0]
    assert (g0 + g_exact[0]).abs().max() > 1e-3


def test_kl_estimators_and_placements():
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=f64)
    ref = torch.tensor([[-1.5, -1.0, -30.0]], dtype=f64)
    raw = lp - ref  # k1/k2 never exponentiate: unclamped (§1.4); k3 clamps before exp
    assert torch.equal(kl_per_token(lp, ref, "k1"), raw)
    torch.testing.assert_close(kl_per_token(lp, ref, "k2"), 0.5 * raw ** 2)
    r = raw.clamp(-20, 20)
    k3 = torch.exp(-r) - 1 + r
    torch.testing.assert_close(kl_per_token(lp, ref, "k3"), k3)
    torch.testing.assert_close(kl_per_token(lp, ref, "low_var"), k3.clamp(max=10))
    assert kl_per_token(lp, ref, "k3")[0, 2].item() == pytest.approx(math.exp(-20) - 1 + 20)
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    rewards = torch.tensor([[0.0, 1.0, 5.0]], dtype=f64)
    out = kl_in_reward(rewards, lp, ref, mask, KLPenaltyConfig(coef=0.1, estimator="k1", placement="reward"))
    torch.testing.assert_close(out, torch.tensor([[-0.05, 1.0 + 0.1, 0.0]], dtype=f64))


def test_kl_and_entropy_terms_in_the_loss():
    B, T = 2, 3
    lp = torch.full((B, T), -1.0, dtype=f64)
    ref = torch.full((B, T), -1.2, dtype=f64)
    ent = torch.full((B, T), 2.0, dtype=f64, requires_grad=True)
    x = lp.clone().requires_grad_()
    inp = LossInputs(x, torch.ones(B, T, dtype=torch.bool), torch.zeros(B, T, dtype=f64), old_logprobs=lp,
                     ref_logprobs=ref, entropy=ent)
    cfg = ObjectiveConfig(kl_penalty=KLPenaltyConfig(coef=0.5, estimator="k1"), entropy=EntropyBonusConfig(coef=0.1),
                          aggregation=AggregationConfig("token_mean"))
    loss, m = rl_loss(inp, cfg)
    assert loss.item() == pytest.approx(0.5 * 0.2 - 0.1 * 2.0)
    assert m["loss/kl"].item() == pytest.approx(0.2) and m["loss/entropy"].item() == pytest.approx(2.0)
    gx, ge = torch.autograd.grad(loss, (x, ent))
    torch.testing.assert_close(gx, torch.full((B, T), 0.5 / 6, dtype=f64))  # PG term is 0 (A = 0)
    torch.testing.assert_close(ge, torch.full((B, T), -0.1 / 6, dtype=f64))
