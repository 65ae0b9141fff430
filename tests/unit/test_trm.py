"""Trust Region Masking and its bound calculator (math_spec §a.7)."""

import math

import pytest
import torch

from megatron_rl.objectives import (
    LossInputs, ObjectiveConfig, PolicyLossConfig, TRMConfig, exact_rollout_kl, rl_loss, select_tokens, trm_bounds,
)
from megatron_rl.objectives.divergence import k2, k3, seq_divergence_stats
from megatron_rl.objectives.trm import trm_mask
from ops_reference import pad_vocab, ref_kl

f64 = torch.float64


def test_toy_sequence_k2_max_and_estimator_table():
    """a.7.1: one token with λ = log 100 among zeros is rejected; all-zeros accepted;
    k2(100) = k2(0.01) = 10.6, k3(100) = 94.4 vs k3(0.01) = 3.6 (PR #4544 table)."""
    lr = torch.zeros(2, 6, dtype=f64)
    lr[0, 3] = math.log(100)
    res = trm_mask(seq_divergence_stats(lr, torch.ones_like(lr, dtype=torch.bool)), TRMConfig(enabled=True, max_kl=0.05))
    assert res.keep.tolist() == [False, True] and not res.exact
    assert res.max_div[0].item() == pytest.approx(0.5 * math.log(100) ** 2)
    x = torch.tensor([math.log(100), math.log(0.01)], dtype=f64)
    assert k2(x).tolist() == pytest.approx([10.6038] * 2, abs=1e-4)
    assert k3(x).tolist() == pytest.approx([94.395, 3.6152], abs=1e-3)
    # k2 <= δ  <=>  |λ| <= sqrt(2δ): δ = 0.05 keeps ρ ∈ [0.73, 1.37]
    edge = math.sqrt(2 * 0.05)
    lr2 = torch.tensor([[edge - 1e-9], [edge + 1e-9], [-edge + 1e-9]], dtype=f64)
    keep = trm_mask(seq_divergence_stats(lr2, torch.ones_like(lr2, dtype=torch.bool)), TRMConfig(enabled=True)).keep
    assert keep.tolist() == [True, False, True]


def test_avg_criterion_is_anded_and_exact_path_uses_exact_kl():
    lr = torch.tensor([[0.1, 0.1, 0.1, 0.1], [0.25, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=f64)
    exact = torch.tensor([[0.01, 0.01, 0.01, 0.01], [0.04, 0.0, 0.0, 0.0], [0.2, 0.0, 0.0, 0.0]], dtype=f64)
    mask = torch.ones_like(lr, dtype=torch.bool)
    st = seq_divergence_stats(lr, mask, exact=exact)
    # sample path: max k2 = 0.005 / 0.03125 / 0; mean k3 ≈ 0.00517 / 0.0084 / 0
    sample = trm_mask(st, TRMConfig(enabled=True, max_kl=0.05, avg_kl=0.006, divergence="sample"))
    assert sample.keep.tolist() == [True, False, True]
    # exact path: max 0.01 / 0.04 / 0.2 ; mean 0.01 / 0.01 / 0.05
    ex = trm_mask(st, TRMConfig(enabled=True, max_kl=0.05, divergence="auto"))
    assert ex.exact and ex.keep.tolist() == [True, True, False]
    ex2 = trm_mask(st, TRMConfig(enabled=True, max_kl=0.05, avg_kl=0.009, divergence="exact"))
    assert ex2.keep.tolist() == [False, False, False]
    with pytest.raises(ValueError, match="rollout_kl"):
        trm_mask(seq_divergence_stats(lr, mask), TRMConfig(enabled=True, divergence="exact"))


def test_empty_sequences_are_kept_and_excluded_from_acceptance():
    lp = torch.full((3, 4), -1.0, dtype=f64)
    roll = lp.clone()
    roll[0, 1] -= 3.0
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2] = False
    inp = LossInputs(lp.clone().requires_grad_(), mask, torch.ones_like(lp), rollout_logprobs=roll)
    cfg = ObjectiveConfig(policy=PolicyLossConfig(mode="bypass"), trm=TRMConfig(enabled=True))
    sel = select_tokens(inp, cfg)
    assert sel.trm.keep.tolist() == [False, True, True]
    _, m = rl_loss(inp, cfg)
    assert m["trm/acceptance_rate"].item() == pytest.approx(0.5)
    assert m["trm/max_div"].item() == pytest.approx(4.5)
    assert m["trm/bound_classical"].item() == pytest.approx(4 * 3 * 4.5)  # T(T-1)δ with T = 4, δ = 4.5


def test_k3_is_unbiased_for_kl_by_enumeration():
    """a.7.2 / check 7: Σ_y μ(y) k3(ρ(y)) = KL(μ‖π) and Σ_y μ(y) k1 = KL(μ‖π)."""
    g = torch.Generator().manual_seed(0)
    mu = torch.softmax(torch.randn(11, generator=g, dtype=f64), 0)
    pi = torch.softmax(torch.randn(11, generator=g, dtype=f64), 0)
    lam = (pi / mu).log()
    kl = (mu * (mu / pi).log()).sum()
    assert (mu * k3(lam)).sum().item() == pytest.approx(kl.item(), abs=1e-12)
    assert (mu * -lam).sum().item() == pytest.approx(kl.item(), abs=1e-12)


def test_bound_table_at_T_4096():
    """a.7.5 / check 8: classical 1677, coupling 79.9, PM-KL 35.0, PM-TV 24.7, Mix-KL 8.2, Mix-TV 4.1."""
    b = trm_bounds(4096, 1e-4, eps=5e-3, dkl_seq=0.01, dtv_seq=0.05)
    assert round(b.classical) == 1677
    assert b.pinsker_marginal_kl == pytest.approx(34.95, abs=0.01)
    assert round(b.pinsker_marginal_tv, 1) == 24.7 and round(b.mixed_kl, 1) == 8.2 and round(b.mixed_tv, 1) == 4.1
    assert round(b.coupling, 1) == 79.9
    assert b.unified == b.mixed_tv and math.isinf(b.adaptive)
    # the closed forms of §a.2 in their regime (δ <= 2/T)
    T, d = 1000, 1e-3
    b2 = trm_bounds(T, d)
    assert b2.pinsker_marginal_kl == pytest.approx(4 / 3 * T ** 1.5 * d, rel=2e-3)
    # adaptive with a constant per-position TV D̄ and T-t small: 4 Σ_t D̄ min(1, (T-t)ε, sqrt((T-t)δ/2))
    dbar = [0.01] * 4
    b3 = trm_bounds(4, 0.02, eps=0.1, mean_tv_per_position=dbar)
    expected = 4 * sum(0.01 * min(1, (4 - t) * 0.1, math.sqrt((4 - t) * 0.02 / 2)) for t in range(1, 5))
    assert b3.adaptive == pytest.approx(expected) and b3.unified <= b3.adaptive


def test_exact_rollout_kl_matches_float64_reference():
    """a.7.6 (single process here; sharded in tests/distributed): KL(μ‖π) over the real vocabulary."""
    g = torch.Generator().manual_seed(1)
    a = pad_vocab(torch.randn(3, 5, 13, generator=g, dtype=f64) * 2, 2, fill=7.0)
    r = pad_vocab(torch.randn(3, 5, 13, generator=g, dtype=f64) * 2, 2, fill=-3.0)
    kl = exact_rollout_kl(a, r, vocab_size=13, temperature=0.8)
    ref, _ = ref_kl(a, r, 13, direction="forward", temperature=0.8)
    torch.testing.assert_close(kl.double(), ref, atol=1e-10, rtol=1e-10)
    mu = torch.softmax(r[..., :13] / 0.8, -1)
    direct = (mu * (torch.log_softmax(r[..., :13] / 0.8, -1) - torch.log_softmax(a[..., :13] / 0.8, -1))).sum(-1)
    torch.testing.assert_close(kl.double(), direct, atol=1e-10, rtol=1e-10)
    assert not kl.requires_grad


def test_bound_metrics_on_the_exact_path_include_the_adaptive_bound():
    lp = torch.full((3, 5), -1.0, dtype=f64)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False
    kl = torch.tensor([[0.01, 0.0, 0.02, 0.0, 0.01], [0.02, 0.02, 0.0, 0.0, 0.0], [0.0, 0.03, 0.0, 0.0, 0.0]],
                      dtype=f64)
    tv = torch.sqrt(kl / 2) * 0.5
    inp = LossInputs(lp.clone().requires_grad_(), mask, torch.ones_like(lp), old_logprobs=lp, rollout_logprobs=lp,
                     rollout_kl=kl, rollout_tv=tv)
    _, m = rl_loss(inp, ObjectiveConfig(trm=TRMConfig(enabled=True, max_kl=0.05)))
    dbar = [tv[mask[:, t], t].mean().item() for t in range(5)]
    b = trm_bounds(5, 0.03, eps=tv.max().item(), dkl_seq=kl.sum(-1).mean().item(), mean_tv_per_position=dbar)
    for k, v in b.as_metrics().items():
        assert m[k].item() == pytest.approx(v, rel=1e-12), k
    assert 0 < b.adaptive < b.coupling and m["trm/max_div"].item() == pytest.approx(0.03)
    # without the TV field, Pinsker's bound on the exact KL stands in for it (a larger, still valid bound)
    _, m2 = rl_loss(LossInputs(lp.clone(), mask, torch.ones_like(lp), old_logprobs=lp, rollout_logprobs=lp,
                               rollout_kl=kl), ObjectiveConfig(trm=TRMConfig(enabled=True, max_kl=0.05)))
    assert m2["trm/bound_adaptive"].item() > m["trm/bound_adaptive"].item()
