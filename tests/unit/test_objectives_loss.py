"""Policy losses, aggregation modes, edge cases and micro-batch invariance of ``rl_loss`` (math_spec §a.5,
§a.7, §e.1, §e.9, §1.4)."""

import math

import pytest
import torch

from megatron_rl.objectives import (
    AggregationConfig, LossInputs, ObjectiveConfig, PolicyLossConfig, RejectionRule, RolloutCorrectionConfig,
    TRMConfig, rl_loss, select_tokens, step_normalizer,
)
from objectives_fixtures import CONFIGS, GRAD_FIELDS, make_inputs, random_batch, rows

f64 = torch.float64


def _inputs(lp, adv, mask=None, **kw):
    lp = lp.clone().requires_grad_()
    mask = torch.ones_like(lp, dtype=torch.bool) if mask is None else mask
    return LossInputs(lp, mask, adv, **kw)


def test_ppo_clip_asymmetric_and_dual_clip_values():
    # one token per case: (log ratio, advantage) -> expected per-token loss
    r = torch.tensor([[1.5, 0.5, 1.05, 5.0, 0.7, 1.5]], dtype=f64)
    adv = torch.tensor([[1.0, -1.0, 2.0, -1.0, 1.0, -2.0]], dtype=f64)
    old = torch.zeros_like(r)
    cfg = ObjectiveConfig(policy=PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=3.0),
                          aggregation=AggregationConfig("fixed", fixed_denominator=1.0))
    inp = _inputs(r.log(), adv, old_logprobs=old)
    loss, m = rl_loss(inp, cfg)
    # A>0, r=1.5: -min(1.5, 1.28) = -1.28 ; A<0, r=0.5: -min(-0.5, -0.8) = 0.8 ; A=2, r=1.05: -2.1 ;
    # A=-1, r=5: max(5, 1.28)=5 -> dual cap 3 ; A=1, r=0.7: -0.7 (not clipped: A>0 below 1-eps) ;
    # A=-2, r=1.5: max(3.0, 2.56) = 3.0 -> cap 6 not active.
    expected = [-1.28, 0.8, -2.1, 3.0, -0.7, 3.0]
    assert loss.item() == pytest.approx(sum(expected), abs=1e-12)
    (g,) = torch.autograd.grad(loss, inp.logprobs)
    # gradient -A r only where the unclipped branch is active
    exp_g = torch.tensor([[0.0, 0.0, -2.1, 0.0, -0.7, 3.0]], dtype=f64)
    torch.testing.assert_close(g, exp_g, atol=1e-12, rtol=0)
    assert m["policy/clip_frac"].item() == pytest.approx(2 / 6)  # tokens 0, 1 (token 3 is dual-clipped)
    assert m["policy/clip_frac_high"].item() == pytest.approx(1 / 6)
    assert m["policy/clip_frac_low"].item() == pytest.approx(1 / 6)
    assert m["policy/dual_clip_frac"].item() == pytest.approx(1 / 6)


def test_gspo_matches_sequence_level_objective():
    """GSPO-token with seq-mean-token-mean gives the value and gradient of the sequence objective
    −(1/N) Σ_i max(−A_i s_i, −A_i clip(s_i)), s_i = exp(mean_t log(π_θ/π_old))."""
    g = torch.Generator().manual_seed(3)
    B, T = 5, 7
    lp = -torch.rand(B, T, generator=g, dtype=f64)
    old = lp + 0.02 * torch.randn(B, T, generator=g, dtype=f64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 4:] = False
    mask[3, 1:] = False
    A = torch.randn(B, 1, generator=g, dtype=f64)
    cfg = ObjectiveConfig(policy=PolicyLossConfig("gspo", clip_eps_low=3e-3, clip_eps_high=4e-3, dual_clip_c=None),
                          aggregation=AggregationConfig("seq_mean_token_mean"))
    inp = _inputs(lp, A.expand(B, T).clone(), mask, old_logprobs=old)
    loss, _ = rl_loss(inp, cfg)
    (grad,) = torch.autograd.grad(loss, inp.logprobs)

    x = lp.clone().requires_grad_()
    s = torch.exp(torch.where(mask, x - old, 0.0).sum(-1) / mask.sum(-1))
    a = A[:, 0]
    ref = torch.maximum(-a * s, -a * s.clamp(1 - 3e-3, 1 + 4e-3)).mean()
    (ref_grad,) = torch.autograd.grad(ref, x)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-12)
    torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=1e-10)
    assert (ref_grad[0] != 0).any() and (ref_grad == 0).any()  # some sequences clipped, some not


def test_bypass_ppo_without_rs_equals_vanilla_ppo_bitwise():
    """e.9.1: bypass + ppo_clip + no RS ≡ PPO with π_old = μ."""
    d = random_batch(seed=4)
    bypass = ObjectiveConfig(policy=PolicyLossConfig(mode="bypass"))
    vanilla = ObjectiveConfig(policy=PolicyLossConfig(mode="decoupled"))
    a = make_inputs(d)
    la, _ = rl_loss(a, bypass)
    d2 = dict(d, old_logprobs=d["rollout_logprobs"])
    d2.pop("rollout_logprobs")
    b = LossInputs(**{k: (v.clone().requires_grad_() if k == "logprobs" else v) for k, v in d2.items()})
    lb, _ = rl_loss(b, vanilla)
    assert torch.equal(la, lb)
    ga = torch.autograd.grad(la, a.logprobs)[0]
    gb = torch.autograd.grad(lb, b.logprobs)[0]
    assert torch.equal(ga, gb)


def test_reinforce_with_is_weights_gradient_is_weighted_score():
    """e.9.2: gradient = −Σ w A ∇log π / D with w constant (stop-gradient through the weight)."""
    d = random_batch(seed=5, junk=False)
    cfg = ObjectiveConfig(policy=PolicyLossConfig("reinforce", mode="bypass"),
                          correction=RolloutCorrectionConfig(is_level="token", is_upper=1.7),
                          aggregation=AggregationConfig("token_mean"))
    inp = make_inputs(d)
    loss, _ = rl_loss(inp, cfg)
    (g,) = torch.autograd.grad(loss, inp.logprobs)
    m = d["mask"]
    w = torch.exp((d["logprobs"] - d["rollout_logprobs"]).clamp(-20, 20)).clamp(max=1.7)
    expected = torch.where(m, -w * d["advantages"] / m.sum(), 0.0)
    torch.testing.assert_close(g, expected, atol=1e-12, rtol=1e-10)


def test_decoupled_weights_multiply_the_clipped_term():
    d = random_batch(seed=6, junk=False)
    cfg = ObjectiveConfig(correction=RolloutCorrectionConfig(is_level="token", is_upper=2.0),
                          aggregation=AggregationConfig("fixed", fixed_denominator=1.0))
    loss, _ = rl_loss(make_inputs(d), cfg)
    m = d["mask"]
    r = torch.exp(d["logprobs"] - d["old_logprobs"])
    w = torch.exp(d["old_logprobs"] - d["rollout_logprobs"]).clamp(max=2.0)
    A = d["advantages"]
    per_tok = torch.maximum(-A * r, -A * r.clamp(0.8, 1.2))
    per_tok = torch.where(A < 0, torch.minimum(per_tok, -3 * A), per_tok)
    assert loss.item() == pytest.approx(torch.where(m, w * per_tok, 0.0).sum().item(), rel=1e-12)


@pytest.mark.parametrize("mode,denominator,expected", [
    ("token_mean", "total", (1 + 2 + 3 + 4) / 6),
    ("token_mean", "kept", (1 + 2 + 3 + 4) / 4),
    ("seq_mean_token_sum", "total", (1 + 2 + 3 + 4) / 3),
    ("seq_mean_token_sum", "kept", (1 + 2 + 3 + 4) / 2),
    ("seq_mean_token_mean", "total", ((1 + 2) / 2 + (3 + 4) / 2) / 3),
    ("seq_mean_token_mean", "kept", ((1 + 2) / 2 + (3 + 4) / 2) / 2),
])
def test_aggregation_modes_hand_example(mode, denominator, expected):
    """REINFORCE with log π = −1 and advantages = the token value, so the per-token loss is the value.
    Sequence 2 (tokens 5, 6) is rejected by a TRM-style max rule; sequence 3 is empty."""
    vals = torch.tensor([[1, 2, 0], [3, 4, 0], [5, 6, 0], [0, 0, 0]], dtype=f64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    roll = torch.full_like(vals, -1.0)
    roll[2, 1] = -3.0  # |λ| = 2 -> k2 = 2 > 1
    cfg = ObjectiveConfig(policy=PolicyLossConfig("reinforce"), aggregation=AggregationConfig(mode, denominator),
                          correction=RolloutCorrectionConfig(rejection=(RejectionRule("k2", "seq_max", upper=1.0),)))
    loss, m = rl_loss(_inputs(torch.full_like(vals, -1.0), vals, mask, old_logprobs=torch.full_like(vals, -1.0),
                              rollout_logprobs=roll), cfg)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert m["correction/seq_acceptance"].item() == pytest.approx(2 / 3)  # the empty sequence is excluded


def test_fixed_denominator():
    vals = torch.tensor([[1.0, 2.0], [3.0, 0.0]], dtype=f64)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    cfg = ObjectiveConfig(policy=PolicyLossConfig("reinforce"), aggregation=AggregationConfig("fixed", fixed_denominator=8))
    loss, _ = rl_loss(_inputs(torch.full_like(vals, -1.0), vals, mask, old_logprobs=torch.zeros_like(vals)), cfg)
    assert loss.item() == pytest.approx(6 / 8)


def test_trm_normalisation_three_quarters():
    """a.7.4: 4 sequences, 1 rejected, equal contributions ⇒ loss = ¾ × unmasked loss."""
    B, T = 4, 5
    lp = torch.full((B, T), -0.5, dtype=f64)
    roll = lp.clone()
    roll[2, 3] = lp[2, 3] - math.log(100)  # one token with ρ = 100
    adv = torch.ones(B, T, dtype=f64)
    for mode in ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean"):
        losses = []
        for enabled in (False, True):
            cfg = ObjectiveConfig(aggregation=AggregationConfig(mode, "total"), trm=TRMConfig(enabled=enabled, max_kl=0.05))
            inp = _inputs(lp, adv, old_logprobs=lp + 0.1, rollout_logprobs=roll)
            losses.append(rl_loss(inp, cfg)[0].item())
        assert losses[1] == pytest.approx(0.75 * losses[0], abs=1e-12), mode
        assert losses[0] != 0


def _all_rejected_cfg():
    return ObjectiveConfig(trm=TRMConfig(enabled=True, max_kl=1e-6),
                           aggregation=AggregationConfig("seq_mean_token_mean", "kept"))


@pytest.mark.parametrize("case", ["all_rejected", "fully_masked", "empty_T"])
def test_loss_exactly_zero_and_attached(case):
    d = random_batch(seed=7)
    if case == "fully_masked":
        d["mask"] = torch.zeros_like(d["mask"])
    if case == "empty_T":
        d = {k: v[:, :0] for k, v in d.items()}
    inp = make_inputs(d)
    loss, m = rl_loss(inp, _all_rejected_cfg())
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(inp.logprobs.grad, torch.zeros_like(inp.logprobs))
    assert m["tokens/kept"].item() == 0
    if case == "all_rejected":
        assert m["trm/acceptance_rate"].item() == 0.0
    else:
        assert "trm/acceptance_rate" not in m and "mismatch/k3" not in m  # empty populations are omitted


def test_nonfinite_inputs_do_not_leak():
    d = random_batch(seed=8)  # NaN / ±inf junk at masked positions
    clean = {k: (torch.where(d["mask"], v, 0.0) if v.dtype == f64 else v) for k, v in d.items()}
    for name, cfg in CONFIGS:
        a, b = make_inputs(d), make_inputs(clean)
        la, ma = rl_loss(a, cfg)
        lb, _ = rl_loss(b, cfg)
        assert torch.isfinite(la) and la.item() == pytest.approx(lb.item(), abs=1e-12), name
        la.backward()
        lb.backward()
        for k in GRAD_FIELDS:
            ga = getattr(a, k).grad
            if ga is not None:
                assert torch.isfinite(ga).all() and torch.equal(ga, getattr(b, k).grad), (name, k)
        assert all(torch.isfinite(v) for v in ma.values()), name
    # a non-finite value at a *valid* position drops that token (and only it) and is counted
    d2 = dict(d, advantages=d["advantages"].clone())
    d2["advantages"][4, 1] = float("nan")
    inp = make_inputs(d2)
    loss, m = rl_loss(inp, CONFIGS[0][1])
    loss.backward()
    assert torch.isfinite(loss) and m["tokens/nonfinite"].item() == 1
    assert m["tokens/valid"].item() == d["mask"].sum().item() - 1
    assert inp.logprobs.grad[4, 1].item() == 0.0 and torch.isfinite(inp.logprobs.grad).all()


@pytest.mark.parametrize("name,cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_micro_batch_invariance(name, cfg):
    """Splitting the batch into micro-batches (with the step normaliser) gives the same loss sum and
    the same gradients as the unsplit batch."""
    d = random_batch(seed=9)
    full = make_inputs(d)
    loss_full, _ = rl_loss(full, cfg)
    loss_full.backward()
    parts = [rows(d, slice(0, 3)), rows(d, slice(3, 8))]
    norm = step_normalizer([make_inputs(p, requires_grad=False) for p in parts], cfg)
    total = 0.0
    grads = {k: [] for k in GRAD_FIELDS}
    for p in parts:
        inp = make_inputs(p)
        loss, _ = rl_loss(inp, cfg, normalizer=norm)
        loss.backward()
        total = total + loss.item()
        for k in GRAD_FIELDS:
            grads[k].append(getattr(inp, k).grad)
    assert total == pytest.approx(loss_full.item(), abs=1e-12)
    for k in GRAD_FIELDS:
        if getattr(full, k).grad is None:  # a field this configuration does not use
            assert all(g is None for g in grads[k])
            continue
        torch.testing.assert_close(torch.cat(grads[k]), getattr(full, k).grad, atol=1e-13, rtol=1e-11)
    sel = select_tokens(make_inputs(d, False), cfg)
    assert sel.seq_keep[1:].any() and (sel.keep != sel.valid).any()  # the case exercises rejection


def test_step_normalizer_kept_counts_every_micro_batch():
    cfg = ObjectiveConfig(aggregation=AggregationConfig("seq_mean_token_sum", "kept"),
                          trm=TRMConfig(enabled=True, max_kl=0.3, divergence="sample"))
    d = random_batch(seed=10)
    sel = select_tokens(make_inputs(d, False), cfg)
    kept_seqs = int((sel.keep.sum(-1) > 0).sum())
    norm = step_normalizer([make_inputs(rows(d, slice(0, 4)), False), make_inputs(rows(d, slice(4, 8)), False)], cfg)
    assert norm.denominator.item() == kept_seqs and 0 < kept_seqs < 7


def test_advantages_must_be_per_token():
    with pytest.raises(ValueError, match="per-token"):
        LossInputs(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.zeros(2))


def test_half_precision_inputs_compute_in_fp32():
    d = random_batch(seed=11, junk=False)
    ref_inp = make_inputs(d)
    ref, _ = rl_loss(ref_inp, CONFIGS[0][1])
    bf = make_inputs({k: (v.to(torch.bfloat16) if v.dtype == f64 else v) for k, v in d.items()})
    loss, m = rl_loss(bf, CONFIGS[0][1])
    loss.backward()
    assert loss.dtype == torch.float32 and bf.logprobs.grad.dtype == torch.bfloat16
    assert loss.item() == pytest.approx(ref.item(), rel=0.02)  # bf16 rounding of the inputs only
    assert all(torch.isfinite(v) for v in m.values())


def test_version_metrics_of_sequences_spanning_weight_versions():
    """LossInputs.policy_version: the tokens of sequences that span versions (partial rollouts), their largest
    span and their mismatch; the loss itself is per token already (each token's own behaviour log-prob)."""
    lp = torch.tensor([[-1.0, -2.0, -0.5, -1.5], [-0.3, -0.2, -0.1, -0.4], [-1.0, -1.0, -1.0, -1.0]], dtype=f64)
    mu = lp + torch.tensor([[0.1, -0.2, 0.3, 0.0], [0.05, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=f64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    version = torch.tensor([[3, 3, 5, 9], [4, 4, 4, 4], [2, 3, -1, -1]])  # row 0's last column is padding
    cfg = ObjectiveConfig(policy=PolicyLossConfig(mode="bypass"), aggregation=AggregationConfig("token_mean"))
    _, m = rl_loss(_inputs(lp, torch.ones_like(lp), mask, rollout_logprobs=mu, policy_version=version), cfg)
    assert m["versions/spanning_token_frac"].item() == pytest.approx(5 / 9)  # rows 0 and 2: 3 + 2 tokens
    assert m["versions/max_span"].item() == 2.0  # row 0: 3..5 (the padded 9 does not count)
    lam = (lp - mu)[[0, 0, 0, 2, 2], [0, 1, 2, 0, 1]]
    assert m["mismatch/k3_spanning"].item() == pytest.approx(float((lam.exp() - 1 - lam).mean()), rel=1e-9)
    _, plain = rl_loss(_inputs(lp, torch.ones_like(lp), mask, rollout_logprobs=mu), cfg)
    assert "versions/max_span" not in plain
