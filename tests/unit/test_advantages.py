"""Advantage estimators (math_spec §d.5, §i, verl semantics for GRPO / RLOO / REINFORCE++)."""

import math

import pytest
import torch

from megatron_rl.advantages import (
    AdvantageConfig, compute_advantages, logit_gradient_proxy, masked_whiten, otb, return_to_go, rtg,
)

f64 = torch.float64


def _outcome(scores, T=3, lengths=None):
    B = len(scores)
    lengths = lengths or [T] * B
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    r = torch.zeros(B, T, dtype=f64)
    r[torch.arange(B), torch.tensor(lengths) - 1] = torch.tensor(scores, dtype=f64)
    return r, mask


def test_grpo_with_and_without_std_and_singleton_groups():
    r, mask = _outcome([1.0, 0.0, 0.0, 1.0, 1.0, 0.5], lengths=[3, 2, 3, 1, 3, 2])
    gid = torch.tensor([7, 7, 7, 7, 9, 5])  # group 5 has one member
    a = compute_advantages(AdvantageConfig("grpo"), r, mask, gid)
    std = math.sqrt(((0.5 ** 2) * 4) / 3)  # unbiased std of [1, 0, 0, 1]
    expected = [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.5 / (std + 1e-6), 1.0 / (1 + 1e-6),
                0.5 / (1 + 1e-6)]
    for i, e in enumerate(expected):
        assert torch.allclose(a[i][mask[i]], torch.tensor(e, dtype=f64))
        assert torch.all(a[i][~mask[i]] == 0)
    dr = compute_advantages(AdvantageConfig("grpo", norm_by_std=False), r, mask, gid)
    assert dr[:, 0].tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 1.0, 0.5])


def test_rloo_leave_one_out():
    r, mask = _outcome([1.0, 0.0, 0.5, 2.0])
    a = compute_advantages(AdvantageConfig("rloo"), r, mask, [0, 0, 0, 1])
    assert a[:, 0].tolist() == pytest.approx([1 - 0.25, 0 - 0.75, 0.5 - 0.5, 2.0])


def test_reinforce_pp_whitened_returns_and_baseline():
    r = torch.tensor([[0.0, 1.0, 0.0, 2.0], [1.0, 0.0, 3.0, 0.0]], dtype=f64)
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 0]], dtype=torch.bool)
    G = return_to_go(r, mask, gamma=0.5)
    # row 0: valid rewards [0, 1, 2] at t = 0, 1, 3 (the masked t = 2 is not a discount step)
    assert G[0].tolist() == pytest.approx([0 + 0.5 * (1 + 0.5 * 2), 1 + 0.5 * 2, 0.0, 2.0])
    assert G[1].tolist() == pytest.approx([1 + 0.5 * (0 + 0.5 * 3), 0 + 0.5 * 3, 3.0, 0.0])
    a = compute_advantages(AdvantageConfig("reinforce_pp", gamma=0.5), r, mask)
    v = a[mask]
    assert v.mean().item() == pytest.approx(0.0, abs=1e-12) and v.std().item() == pytest.approx(1.0, abs=1e-6)
    torch.testing.assert_close(a, masked_whiten(G, mask))
    b = compute_advantages(AdvantageConfig("reinforce_pp_baseline"), r, mask, [3, 3])
    # scores 3 and 4 -> minus group mean 3.5 -> ±0.5 broadcast, then whitened over the 6 valid tokens
    raw = torch.where(mask, torch.tensor([[-0.5], [0.5]], dtype=f64), 0.0)
    torch.testing.assert_close(b, masked_whiten(raw, mask))


def _otb_hand_example():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    rew = torch.tensor([[0, 0, 1.0], [0, 0, 0]], dtype=f64)
    logp = torch.log(torch.tensor([[0.5, 0.9, 0.8], [0.5, 0.2, 1.0]], dtype=f64))
    spi2 = torch.tensor([[0.5, 0.82, 0.68], [0.5, 0.5, 1.0]], dtype=f64)
    return rew, mask, logp, spi2


def test_otb_hand_example():
    """d.5.1 / check 9: w = [.5,.02,.08],[.5,1.1]; W = [.5,.52,.60],[.5,1.6]; B* = [0.5, 0.52/2.12, 1.0]."""
    rew, mask, logp, spi2 = _otb_hand_example()
    w = logit_gradient_proxy(logp, spi2, mask)
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.02, 0.08], [0.5, 1.1, 0.0]], dtype=f64))
    a = otb(rew, mask, [0, 0], logp, spi2, handle_zero_tail=False)
    B = torch.tensor([0.5, 0.52 / 2.12, 1.0], dtype=f64)
    G = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], dtype=f64)
    expected = torch.where(mask, G - B, 0.0)
    torch.testing.assert_close(a, expected, atol=1e-7, rtol=1e-6)  # eps = 1e-8 in the denominators
    assert abs(a[0, 2].item()) < 1e-7  # the tail baseline is its own return
    z = otb(rew, mask, [0, 0], logp, spi2, handle_zero_tail=True)
    assert z[0, 2].item() == pytest.approx(1.0) and torch.allclose(z[:, :2], a[:, :2])


def test_otb_special_cases_and_proxy_identity():
    """d.5.2-3: N = 1 ⇒ A = G; equal W ⇒ B* = mean of G over responses valid at t;
    w = ‖∇_z log π(y)‖² ∈ [0, 2]."""
    rew, mask, logp, spi2 = _otb_hand_example()
    a1 = otb(rew, mask, [0, 1], logp, spi2)
    torch.testing.assert_close(a1, torch.where(mask, return_to_go(rew, mask), 0.0))
    g = torch.Generator().manual_seed(0)
    r = torch.rand(4, 5, generator=g, dtype=f64)
    m = torch.ones(4, 5, dtype=torch.bool)
    flat = torch.full((4, 5), math.log(0.5), dtype=f64)
    a = otb(r, m, [0, 0, 0, 0], flat, torch.full((4, 5), 0.5, dtype=f64))
    G = return_to_go(r, m)
    torch.testing.assert_close(a, G - G.mean(0, keepdim=True), atol=1e-7, rtol=1e-7)
    z = torch.randn(6, 13, generator=g, dtype=f64, requires_grad=True)
    y = torch.randint(0, 13, (6,), generator=g)
    lp = torch.log_softmax(z, -1)
    w = logit_gradient_proxy(lp.gather(-1, y[:, None]).squeeze(-1).detach(), (lp.exp() ** 2).sum(-1).detach(),
                             torch.ones(6, dtype=torch.bool))
    for i in range(6):
        (gz,) = torch.autograd.grad(lp[i, y[i]], z, retain_graph=True)
        assert (gz ** 2).sum().item() == pytest.approx(w[i].item(), abs=1e-12)
    assert (w >= 0).all() and (w <= 2).all()


def test_otb_is_weights_and_valid_token_alignment():
    rew, mask, logp, spi2 = _otb_hand_example()
    ones = otb(rew, mask, [0, 0], logp, spi2, is_weights=torch.ones_like(logp))
    torch.testing.assert_close(ones, otb(rew, mask, [0, 0], logp, spi2))
    # multi-turn: a tool segment (masked hole) in response 0; aligned by valid-token index it equals the
    # compact example above
    hole = torch.tensor([[1, 0, 0, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    spread = lambda x: torch.stack([torch.tensor([x[0, 0], 9, 9, x[0, 1], x[0, 2]]),  # noqa: E731
                                    torch.tensor([x[1, 0], x[1, 1], 9, 9, 9])]).to(f64)
    a = otb(spread(rew) * hole, hole, [0, 0], spread(logp), spread(spi2), align="valid_token", handle_zero_tail=False)
    compact = otb(rew, mask, [0, 0], logp, spi2, handle_zero_tail=False)
    torch.testing.assert_close(a[hole], compact[mask])
    assert torch.all(a[~hole] == 0)


def test_per_token_rewards_are_recoverable_from_advantages():
    """§i oracle: with a context-only baseline b_t, r_t = (A_t + b_t) − (A_{t+1} + b_{t+1})."""
    g = torch.Generator().manual_seed(1)
    r = torch.randn(4, 6, generator=g, dtype=f64)
    mask = torch.ones(4, 6, dtype=torch.bool)
    gid = [0, 0, 1, 1]
    a = compute_advantages(AdvantageConfig("rtg"), r, mask, gid)
    G = return_to_go(r, mask)
    b = G - a
    torch.testing.assert_close(b[0], b[1])  # the baseline is shared by the group: a function of position only
    torch.testing.assert_close(b[0], G[:2].mean(0))
    Gr = a + b
    rec = Gr - torch.cat([Gr[:, 1:], torch.zeros(4, 1, dtype=f64)], 1)
    torch.testing.assert_close(rec, r)
    torch.testing.assert_close(rtg(r, mask, baseline="none"), G)
    # the scalar path collapses the sequence: per-token structure is lost
    scalar = compute_advantages(AdvantageConfig("grpo", norm_by_std=False), r, mask, gid)
    assert torch.all(scalar == scalar[:, :1])


def test_missing_inputs_raise():
    r, mask = _outcome([1.0, 0.0])
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages(AdvantageConfig("grpo"), r, mask)
    with pytest.raises(ValueError, match="sum_pi_squared"):
        compute_advantages(AdvantageConfig("otb"), r, mask, [0, 0])
