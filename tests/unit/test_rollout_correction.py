"""Rollout correction: IS weights, rejection rules, presets, metrics (math_spec §e.9, §f.4)."""

import itertools
import math

import pytest
import torch

from megatron_rl.objectives import (
    PRESETS, AggregationConfig, LossInputs, ObjectiveConfig, PolicyLossConfig, RejectionRule, RolloutCorrectionConfig,
    rl_loss, select_tokens, step_normalizer,
)
from megatron_rl.objectives.divergence import seq_divergence_stats
from megatron_rl.objectives.rollout_correction import compute_correction
from objectives_fixtures import make_inputs, random_batch, rows

f64 = torch.float64


def _correct(log_ratio, mask, cfg):
    return compute_correction(log_ratio, mask, seq_divergence_stats(log_ratio, mask), cfg)


def test_sequence_is_weight_is_truncated_product_on_every_token():
    """e.9.3."""
    g = torch.Generator().manual_seed(0)
    lr = 0.4 * torch.randn(6, 5, generator=g, dtype=f64)
    mask = torch.ones(6, 5, dtype=torch.bool)
    mask[2, 3:] = False
    c = _correct(lr, mask, RolloutCorrectionConfig(is_level="sequence", is_upper=2.0))
    expected = torch.exp(torch.where(mask, lr, 0.0).sum(-1)).clamp(max=2.0)
    assert (expected == 2.0).any() and (expected < 2.0).any()
    torch.testing.assert_close(torch.where(mask, c.weights, 0.0), torch.where(mask, expected[:, None], 0.0))
    torch.testing.assert_close(c.seq_weights, expected)


def test_token_tis_and_extreme_ratios_are_exact_in_log_space():
    lr = torch.tensor([[0.1, 25.0, -30.0, math.log(2.0) + 1e-9]], dtype=f64)  # beyond the ±20 clamp
    c = _correct(lr, torch.ones_like(lr, dtype=torch.bool), RolloutCorrectionConfig(is_level="token", is_upper=2.0))
    torch.testing.assert_close(c.weights, torch.tensor([[math.exp(0.1), 2.0, math.exp(-20), 2.0]], dtype=f64))
    assert c.is_truncated.tolist() == [[False, True, False, True]]


def test_k1_bounds_are_on_the_ratio_not_verls_inverted_interval():
    """e.9.5 / check 12: lower=0.6, upper=1.6 keeps exactly ρ ∈ [0.6, 1.6] (verl would keep [0.625, 1.667])."""
    rs = torch.tensor([[0.59, 0.6, 0.62, 1.6, 1.61, 1.65, 1.67]], dtype=f64)
    mask = torch.ones_like(rs, dtype=torch.bool)
    for rule in (RejectionRule("k1", "token", 0.6, 1.6), RejectionRule.parse("token_k1", "0.6_1.6")):
        c = _correct(rs.log(), mask, RolloutCorrectionConfig(rejection=(rule,)))
        assert c.token_keep.tolist() == [[False, True, True, True, False, False, False]]
    # a single float u means [1/u, u], as in verl
    assert RejectionRule.parse("seq_sum_k1", "2.0") == RejectionRule("k1", "seq_sum", 0.5, 2.0)
    assert RejectionRule.parse("seq_max_k2", "2.5") == RejectionRule("k2", "seq_max", None, 2.5)


def test_rules_are_anded_at_token_and_sequence_level():
    lr = torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.2, 0.0], [0.5, 0.5, 0.5], [0.0, 0.0, 0.0]], dtype=f64)
    mask = torch.ones_like(lr, dtype=torch.bool)
    mask[3] = False  # empty sequence: never "rejected"
    rules = (RejectionRule("k1", "token", upper=3.0),          # ρ_t <= 3: token (1,1) has ρ = 3.32 -> dropped
             RejectionRule("k1", "seq_mean", 0.9, 1.6))       # geo over valid tokens: row 1 e^0.4 = 1.49 kept,
    #                                                            row 2 e^0.5 = 1.65 rejected
    c = _correct(lr, mask, RolloutCorrectionConfig(rejection=rules))
    assert c.seq_keep.tolist() == [True, True, False, True]
    keep = c.token_keep & c.seq_keep[:, None] & mask
    assert keep.tolist() == [[True] * 3, [True, False, True], [False] * 3, [False] * 3]
    assert c.rejected_by["token_k1"].sum() == 1 and c.rejected_by["seq_mean_k1"].tolist() == [False, False, True, False]
    # k2 / k3 at every level
    lr2 = torch.tensor([[0.1, -1.0, 0.1], [0.1, 0.1, 0.1]], dtype=f64)
    m2 = torch.ones_like(lr2, dtype=torch.bool)
    k3 = lambda x: math.expm1(x) - x  # noqa: E731
    for rule, expect in [
        (RejectionRule("k2", "token", upper=0.4), [[True, False, True], [True] * 3]),
        (RejectionRule("k2", "seq_max", upper=0.4), [[False] * 3, [True] * 3]),
        (RejectionRule("k2", "seq_sum", upper=0.5 + 0.01 - 1e-9), [[False] * 3, [True] * 3]),
        (RejectionRule("k3", "seq_mean", upper=(2 * k3(0.1) + k3(-1.0)) / 3 - 1e-9), [[False] * 3, [True] * 3]),
        (RejectionRule("k3", "seq_max", upper=k3(-1.0) + 1e-9), [[True] * 3, [True] * 3]),
    ]:
        c = _correct(lr2, m2, RolloutCorrectionConfig(rejection=(rule,)))
        assert (c.token_keep & c.seq_keep[:, None]).tolist() == expect, rule


def test_length_trap_and_geometric_mask():
    """f.4: a constant per-token ratio r gives ρ_geo = r for every length; the sequence product rejects
    long sequences (1.1^10 ≈ 2.6 kept, 1.1^100 ≈ 13 780 rejected at an upper bound of 10)."""
    T = 100
    lr = torch.full((2, T), math.log(1.1), dtype=f64)
    mask = torch.zeros(2, T, dtype=torch.bool)
    mask[0, :10] = True
    mask[1, :] = True
    stats = seq_divergence_stats(lr, mask)
    torch.testing.assert_close(torch.exp(stats.mean_log_ratio), torch.full((2,), 1.1, dtype=f64))
    seq = _correct(lr, mask, RolloutCorrectionConfig(rejection=(RejectionRule("k1", "seq_sum", 0.1, 10.0),)))
    geo = _correct(lr, mask, RolloutCorrectionConfig(rejection=(RejectionRule("k1", "seq_mean", 0.5, 2.0),)))
    assert seq.seq_keep.tolist() == [True, False] and geo.seq_keep.tolist() == [True, True]


def test_seq_mis_bias_identity_by_enumeration():
    """f.4 oracle 2: with ĝ = ρ(y) 1{ρ(y) <= C} f(y), E_μ[ĝ] − E_π[f] = −E_π[f 1(ρ > C)]."""
    g = torch.Generator().manual_seed(1)
    V, C = 3, 1.3
    mu1, pi1 = torch.softmax(torch.randn(V, generator=g, dtype=f64), 0), torch.softmax(torch.randn(V, generator=g, dtype=f64), 0)
    mu2, pi2 = (torch.softmax(torch.randn(V, V, generator=g, dtype=f64), 1) for _ in range(2))
    f = torch.randn(V, V, generator=g, dtype=f64)
    ys = list(itertools.product(range(V), range(V)))
    lr = torch.tensor([[math.log(pi1[a] / mu1[a]), math.log(pi2[a, b] / mu2[a, b])] for a, b in ys], dtype=f64)
    mu = torch.tensor([mu1[a] * mu2[a, b] for a, b in ys], dtype=f64)
    pi = torch.tensor([pi1[a] * pi2[a, b] for a, b in ys], dtype=f64)
    fy = torch.tensor([f[a, b] for a, b in ys], dtype=f64)
    c = _correct(lr, torch.ones_like(lr, dtype=torch.bool),
                 RolloutCorrectionConfig(is_level="sequence", is_mode="mask", is_upper=C))
    est = (mu * torch.where(c.seq_keep, c.seq_weights, 0.0) * fy).sum()
    rho = pi / mu
    assert (rho > C).any() and (rho <= C).any()
    bias = -(pi * fy * (rho > C)).sum()
    assert (est - (pi * fy).sum()).item() == pytest.approx(bias.item(), abs=1e-12)


def test_icepop_and_two_sided_seq_mis():
    lr = torch.tensor([[0.0, math.log(3.0), math.log(0.3)], [0.1, 0.1, 0.1]], dtype=f64)
    mask = torch.ones_like(lr, dtype=torch.bool)
    ice = _correct(lr, mask, PRESETS["icepop"])
    assert ice.token_keep.tolist() == [[True, False, False], [True] * 3]
    torch.testing.assert_close(ice.weights[1], torch.full((3,), math.exp(0.1), dtype=f64))
    mis = _correct(lr, mask, PRESETS["seq_mis"])  # ρ(y) = 0.9 and e^0.3 = 1.35: both inside [0.5, 2]
    assert mis.seq_keep.tolist() == [True, True]
    torch.testing.assert_close(mis.seq_weights, torch.tensor([0.9, math.exp(0.3)], dtype=f64))
    mis_hi = _correct(lr, mask, RolloutCorrectionConfig(is_level="sequence", is_mode="mask", is_lower=0.95, is_upper=2))
    assert mis_hi.seq_keep.tolist() == [False, True]


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalised_weights_have_mean_one(level):
    """e.9.4: over the step's surviving tokens (token level) / sequences (sequence level)."""
    d = random_batch(seed=2)
    cfg = ObjectiveConfig(correction=RolloutCorrectionConfig(is_level=level, is_upper=1.5, is_batch_normalize=True,
                                                             rejection=(RejectionRule("k2", "seq_max", upper=2.0),)))
    parts = [make_inputs(rows(d, slice(0, 5)), False), make_inputs(rows(d, slice(5, 8)), False)]
    norm = step_normalizer(parts, cfg)
    sels = [select_tokens(p, cfg) for p in parts]
    if level == "token":
        w = torch.cat([s.weights[s.keep] for s in sels]) / norm.is_weight_mean
    else:
        w = torch.cat([s.seq_weights[s.keep.any(-1)] for s in sels]) / norm.is_weight_mean
    assert w.mean().item() == pytest.approx(1.0, abs=1e-12) and w.std() > 0.01
    _, m = rl_loss(make_inputs(d), cfg)
    assert m["is/weight_mean"].item() == pytest.approx(1.0, abs=1e-12)


def test_metrics_vanish_when_rollout_equals_old():
    """e.9.6: μ = π_old ⇒ χ² = 0, KL = 0, PPL ratio = 1, ESS = 1, every sequence accepted."""
    d = random_batch(seed=3)
    d["rollout_logprobs"] = d["old_logprobs"].clone()
    cfg = ObjectiveConfig(correction=RolloutCorrectionConfig(is_level="token", rejection=(
        RejectionRule("k2", "seq_max", upper=1e-6),)))
    _, m = rl_loss(make_inputs(d), cfg)
    for k in ("mismatch/k1", "mismatch/k3", "mismatch/chi2_token", "mismatch/chi2_seq", "mismatch/max_k2",
              "mismatch/log_ppl_abs_diff", "is/truncated_frac"):
        assert m[k].item() == pytest.approx(0.0, abs=1e-12), k
    for k in ("mismatch/ppl_ratio", "is/ess", "is/weight_mean", "correction/seq_acceptance"):
        assert m[k].item() == pytest.approx(1.0, abs=1e-12), k


def test_mismatch_metric_values():
    lr = torch.tensor([[0.2, -0.4, 0.0], [0.5, 0.0, 0.0]], dtype=f64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    old = torch.full_like(lr, -1.0)
    inp = LossInputs(old.clone().requires_grad_(), mask, torch.zeros_like(lr), old_logprobs=old,
                     rollout_logprobs=old - lr)
    _, m = rl_loss(inp, ObjectiveConfig(correction=RolloutCorrectionConfig(is_level="token", is_upper=1.5)))
    v = lr[mask]
    assert m["mismatch/k1"].item() == pytest.approx((-v).mean().item())
    assert m["mismatch/k3"].item() == pytest.approx((torch.expm1(v) - v).mean().item())
    assert m["mismatch/chi2_token"].item() == pytest.approx(torch.exp(2 * v).mean().item() - 1)
    assert m["mismatch/max_k2"].item() == pytest.approx(0.125)
    assert m["mismatch/chi2_seq"].item() == pytest.approx((math.exp(2 * -0.2) + math.exp(1.0)) / 2 - 1)
    assert m["mismatch/log_ppl_abs_diff"].item() == pytest.approx((0.2 / 3 + 0.5) / 2)
    w = torch.exp(v).clamp(max=1.5)
    assert m["is/ess"].item() == pytest.approx((w.mean() ** 2 / (w ** 2).mean()).item())
    assert m["is/weight_max"].item() == pytest.approx(1.5) and m["is/weight_min"].item() == pytest.approx(math.exp(-0.4))
    assert m["is/truncated_frac"].item() == pytest.approx(1 / 4)


def test_bypass_statistics_use_the_current_policy():
    d = random_batch(seed=4, junk=False)
    cfg = ObjectiveConfig(policy=PolicyLossConfig("reinforce", mode="bypass"),
                          correction=RolloutCorrectionConfig(is_level="token", is_upper=100.0))
    sel = select_tokens(make_inputs(d), cfg)
    m = d["mask"]
    torch.testing.assert_close(sel.weights[m], torch.exp(d["logprobs"] - d["rollout_logprobs"])[m])
    assert not sel.weights.requires_grad


def test_presets_are_valid_configs():
    assert set(PRESETS) >= {"token_tis", "seq_tis", "icepop", "seq_mis", "geo_rs", "k3_rs"}
    lr = 1e-4 * torch.ones(2, 3, dtype=f64)
    for name, cfg in PRESETS.items():
        c = _correct(lr, torch.ones_like(lr, dtype=torch.bool), cfg)
        assert c.seq_keep.all(), name  # a tiny drift passes every preset
    assert not _correct(0.01 * torch.ones(1, 3, dtype=f64), torch.ones(1, 3, dtype=torch.bool), PRESETS["geo_rs"]).seq_keep.any()


def test_aggregation_with_kept_denominator_and_token_rejection():
    lp = torch.zeros(1, 4, dtype=f64)
    roll = torch.tensor([[0.0, 0.0, -3.0, 0.0]], dtype=f64)  # token 2: ρ = e^3 rejected by ρ <= 2
    adv = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=f64)
    for denom, expected in (("total", -(1 + 2 + 4) / 4), ("kept", -(1 + 2 + 4) / 3)):
        cfg = ObjectiveConfig(aggregation=AggregationConfig("token_mean", denom),
                              correction=RolloutCorrectionConfig(rejection=(RejectionRule("k1", "token", upper=2.0),)))
        loss, _ = rl_loss(LossInputs(lp.clone().requires_grad_(), torch.ones_like(lp, dtype=torch.bool), adv,
                                     old_logprobs=lp, rollout_logprobs=roll), cfg)
        assert loss.item() == pytest.approx(expected)
