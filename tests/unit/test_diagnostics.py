"""§h and §i diagnostics: the gain decomposition on an enumerable toy (§h check 10) and reward entropy."""

import itertools
import math

import pytest
import torch

from megatron_rl.diagnostics import entropy_bits, gain_decomposition, reward_entropy_bits

f64 = torch.float64


def _enumerate(seed: int, V: int = 3, scale: float = 0.7):
    """A 2-step tabular policy over V tokens, an update θ → θ′ and rewards in [0, 1], enumerated:
    every sequence (y1, y2) with P^θ(τ), log π_θ(y_t | c_t), log π_θ′(y_t | c_t) and R(τ)."""
    g = torch.Generator().manual_seed(seed)
    z1, z2 = torch.randn(V, generator=g, dtype=f64), torch.randn(V, V, generator=g, dtype=f64)
    d1, d2 = scale * torch.randn(V, generator=g, dtype=f64), scale * torch.randn(V, V, generator=g, dtype=f64)
    R = torch.rand(V, V, generator=g, dtype=f64)
    lp = lambda a, b: (torch.log_softmax(a, -1), torch.log_softmax(b, -1))  # noqa: E731
    (o1, o2), (n1, n2) = lp(z1, z2), lp(z1 + d1, z2 + d2)
    seqs = list(itertools.product(range(V), repeat=2))
    old = torch.tensor([[o1[a], o2[a, b]] for a, b in seqs], dtype=f64)
    new = torch.tensor([[n1[a], n2[a, b]] for a, b in seqs], dtype=f64)
    rew = torch.tensor([R[a, b] for a, b in seqs], dtype=f64)
    return old, new, rew, old.sum(-1).exp(), new.sum(-1).exp()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gain_is_tangent_plus_remainder_on_an_enumerable_toy(seed):
    old, new, R, P, P2 = _enumerate(seed)
    assert P.sum().item() == pytest.approx(1.0) and P2.sum().item() == pytest.approx(1.0)
    mask = torch.ones_like(old, dtype=torch.bool)
    m = gain_decomposition(R, [0] * len(R), old, new, mask, weights=P)
    gain = float((P2 * R).sum() - (P * R).sum())  # J(θ′) − J(θ), directly
    b = float((P * R).sum())
    log_rho = torch.log(P2 / P)
    kl = float((P * torch.log(P / P2)).sum())  # KL(P^θ ‖ P^θ′) over whole sequences
    assert m["gain/estimate"] == pytest.approx(gain, abs=1e-12)
    assert m["gain/tangent"] + m["gain/remainder"] == pytest.approx(gain, abs=1e-12)
    assert m["gain/tangent"] == pytest.approx(float((P * (R - b) * log_rho).sum()), abs=1e-12)  # Cov(R, log ρ)
    assert m["gain/remainder"] == pytest.approx(float((P * (R - b) * (P2 / P - 1 - log_rho)).sum()), abs=1e-12)
    assert m["gain/seq_kl"] == pytest.approx(kl, abs=1e-12)  # E[Σ_t k3] = sequence KL (chain rule)
    max_dev = float((R - b).abs().max())
    assert abs(m["gain/remainder"]) <= max_dev * kl + 1e-15
    assert m["gain/slack"] == pytest.approx(max_dev * kl)  # default R_max: the largest |R − b|
    assert abs(m["gain/remainder"]) > 1e-4  # the update is large enough for the bound to be tested
    r1 = gain_decomposition(R, [0] * len(R), old, new, mask, reward_max=1.0, weights=P)
    assert r1["gain/slack"] == pytest.approx(kl) and r1["gain/signal_to_slack"] == pytest.approx(r1["gain/tangent"] / kl)


def test_gain_uses_a_per_prompt_baseline_and_skips_empty_sequences():
    """Two prompts enumerated side by side (weights summing to 1 per prompt): the metrics are the mean of
    each prompt's exact values. An empty sequence (no valid token) changes nothing."""
    a, b = _enumerate(3), _enumerate(4)
    cat = [torch.cat([x, y]) for x, y in zip(a, b)]
    old, new, R, P, _ = cat
    mask = torch.ones_like(old, dtype=torch.bool)
    gid = [0] * 9 + [1] * 9
    both = gain_decomposition(R, gid, old, new, mask, reward_max=1.0, weights=P)
    each = [gain_decomposition(x[2], [0] * 9, x[0], x[1], torch.ones_like(x[0], dtype=torch.bool), reward_max=1.0,
                               weights=x[3]) for x in (a, b)]
    for k in ("gain/tangent", "gain/estimate", "gain/seq_kl", "gain/slack"):
        assert both[k] == pytest.approx((each[0][k] + each[1][k]) / 2, abs=1e-12)
    pad = lambda t, v: torch.cat([t, torch.full((1, 2), v, dtype=f64)])  # noqa: E731
    m2 = gain_decomposition(torch.cat([R, torch.tensor([5.0], dtype=f64)]), gid + [0], pad(old, 0.0), pad(new, 9.0),
                            torch.cat([mask, torch.zeros(1, 2, dtype=torch.bool)]), reward_max=1.0,
                            weights=torch.cat([P, torch.ones(1, dtype=f64)]))
    assert m2 == pytest.approx(both)


def test_reward_entropy_bits():
    assert entropy_bits([1.0, 0.0, 1.0, 0.0]) == pytest.approx(1.0)  # pass/fail: at most one bit
    assert entropy_bits([1.0] * 8) == 0.0
    assert entropy_bits([0.0, 0.25, 0.5, 0.75]) == pytest.approx(2.0)  # log2 B for B equally likely values
    assert entropy_bits([1.0, 0.0, 0.0, 0.0]) == pytest.approx(-(0.25 * math.log2(0.25) + 0.75 * math.log2(0.75)))
    # per-token rewards: the whole reward sequence is the outcome
    assert entropy_bits([(0.0, 1.0), (1.0, 0.0), (0.0, 1.0), (1.0, 0.0)]) == pytest.approx(1.0)
    assert reward_entropy_bits([[1.0, 0.0], [1.0, 1.0]]) == pytest.approx(0.5)
