"""Four deviations from the reference semantics, each pinned by a case that failed before the fix:
sequence IS weights clamp the *sum* of log-ratios (§e.2); k1/k2 KL penalties keep their gradient past
|log-ratio| = 20 (§1.4); GSPO has no dual clip unless asked; OTB counts only non-empty group members (§d.1)."""

import math

import pytest
import torch

from megatron_rl.advantages import AdvantageConfig, compute_advantages, otb
from megatron_rl.config_io import build
from megatron_rl.objectives import LossInputs, ObjectiveConfig, PolicyLossConfig, RolloutCorrectionConfig, select_tokens
from megatron_rl.objectives.kl_penalty import kl_per_token
from megatron_rl.objectives.policy_loss import gspo_token_loss

f64 = torch.float64


def test_sequence_is_weight_clamps_the_sum_of_log_ratios():
    """λ = (25, −24): ρ(y) = e¹. Per-token clamping first would give exp(20 − 20) = 1."""
    lam = torch.tensor([[25.0, -24.0], [-25.0, 24.5]], dtype=f64)
    rollout = torch.full_like(lam, -30.0)
    x = LossInputs(logprobs=rollout + lam, mask=torch.ones_like(lam, dtype=torch.bool),
                   advantages=torch.ones_like(lam), old_logprobs=rollout + lam, rollout_logprobs=rollout)
    sel = select_tokens(x, ObjectiveConfig(correction=RolloutCorrectionConfig(is_level="sequence", is_upper=10.0)))
    torch.testing.assert_close(sel.seq_weights, torch.tensor([math.e, math.exp(-0.5)], dtype=f64))
    torch.testing.assert_close(sel.weights, torch.tensor([[math.e] * 2, [math.exp(-0.5)] * 2], dtype=f64))
    assert not sel.correction.is_truncated.any()
    # a sum beyond ±20 is clamped before exponentiating (then capped at C)
    far = select_tokens(LossInputs(logprobs=rollout + 30, mask=x.mask, advantages=x.advantages,
                                   old_logprobs=rollout + 30, rollout_logprobs=rollout),
                        ObjectiveConfig(correction=RolloutCorrectionConfig(is_level="sequence", is_upper=1e12)))
    torch.testing.assert_close(far.seq_weights, torch.full((2,), math.exp(20.0), dtype=f64))


@pytest.mark.parametrize("estimator, grad", [("k1", 1.0), ("k2", 25.0)])
def test_k1_k2_penalties_keep_their_gradient_beyond_twenty(estimator, grad):
    logp = torch.tensor([-1.0], dtype=f64, requires_grad=True)
    ref = torch.tensor([-26.0], dtype=f64)  # log-ratio 25
    kl = kl_per_token(logp, ref, estimator)
    (g,) = torch.autograd.grad(kl.sum(), logp)
    assert g.item() == pytest.approx(grad)
    assert kl.item() == pytest.approx(25.0 if estimator == "k1" else 312.5)
    # k3 exponentiates: its log-ratio stays clamped (finite value)
    assert torch.isfinite(kl_per_token(logp.detach() - 100, ref, "k3")).all()


def test_gspo_has_no_dual_clip_unless_asked():
    assert PolicyLossConfig().dual_clip_c == 3.0
    assert PolicyLossConfig(loss="gspo").dual_clip_c is None
    assert PolicyLossConfig(loss="gspo", dual_clip_c=2.5).dual_clip_c == 2.5
    assert build(PolicyLossConfig, {"loss": "gspo"}).dual_clip_c is None
    assert build(PolicyLossConfig, {"loss": "gspo", "dual_clip_c": 3}).dual_clip_c == 3.0
    with pytest.raises(ValueError, match="dual_clip_c='sometimes'"):
        PolicyLossConfig(dual_clip_c="sometimes")
    # A < 0 and a sequence ratio of e (> c = 3 would cap at 3|A|): the GSPO loss is −A·s = e·|A| ... and at
    # s = 5 it stays 5|A|, uncapped
    anchor = torch.zeros(1, 4, dtype=f64)
    logp = torch.full((1, 4), math.log(5.0), dtype=f64)
    adv = torch.full((1, 4), -1.0, dtype=f64)
    keep = torch.ones(1, 4, dtype=torch.bool)
    term = gspo_token_loss(logp, anchor, adv, keep, PolicyLossConfig(loss="gspo"))
    torch.testing.assert_close(term.loss, torch.full((1, 4), 5.0, dtype=f64))
    assert not term.dual_clipped.any()
    capped = gspo_token_loss(logp, anchor, adv, keep, PolicyLossConfig(loss="gspo", dual_clip_c=3.0))
    torch.testing.assert_close(capped.loss, torch.full((1, 4), 3.0, dtype=f64))


@pytest.mark.parametrize("zero_tail", [False, True])
def test_otb_counts_only_nonempty_group_members(zero_tail):
    """Response 0's only group-mate (response 1) is empty: its baseline is 0 and A = G, whatever
    handle_zero_tail says; group 1 (two non-empty members) keeps its usual baseline."""
    mask = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    rew = torch.tensor([[0, 0, 1.0], [0, 0, 0], [0, 1.0, 0], [0, 0, 0]], dtype=f64)
    logp = torch.full((4, 3), math.log(0.5), dtype=f64)
    spi2 = torch.full((4, 3), 0.5, dtype=f64)
    a = otb(rew, mask, [0, 0, 1, 1], logp, spi2, handle_zero_tail=zero_tail)
    torch.testing.assert_close(a[0], torch.ones(3, dtype=f64))
    assert torch.all(a[1] == 0)
    torch.testing.assert_close(a[2, :2], torch.full((2,), 0.5, dtype=f64), atol=1e-7, rtol=0)
    # the return-to-go estimator shares the baseline rule
    r = compute_advantages(AdvantageConfig("rtg"), rew, mask, [0, 0, 1, 1])
    torch.testing.assert_close(r[0], torch.ones(3, dtype=f64))
