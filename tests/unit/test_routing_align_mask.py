"""MoE routing replay without Megatron: aligning engine samples to the trainer's layout (and every check
that fails loudly), route checksums through micro-batch splitting, agreement counting, and the
routing-aware mask composing with TRM and masked IS."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.objectives import (
    LossInputs, ObjectiveConfig, PolicyLossConfig, RolloutCorrectionConfig, RoutingMaskConfig, TRMConfig, rl_loss,
    select_tokens,
)
from megatron_rl.rollout.client.protocol import Sample
from megatron_rl.routing import (
    FREE, AgreementTracker, RoutingLayout, attach_routes, check_route_checksums, sample_routes, token_checksum,
)
from megatron_rl.training import TrainBatch, make_micro_batches

LAYOUT = RoutingLayout(num_moe_layers=2, topk=2, num_experts=4)


def _ids(n, seed, layers=2, topk=2, experts=4):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(experts, generator=g)[:topk] for _ in range(n * layers)]
    return torch.stack(rows).reshape(n, layers, topk)


def _sample(P, R, seed=0, last_missing=False, **kw):
    ids = _ids(P + R, seed, **kw).int()
    if last_missing:
        ids[-1] = -1
    g = torch.Generator().manual_seed(100 + seed)
    return Sample(prompt_ids=torch.randint(1, 50, (P,), generator=g).tolist(),
                  response_ids=torch.randint(1, 50, (R,), generator=g).tolist(), logprobs=[-1.0] * R,
                  finish_reason="length", routed_experts=ids[P:], prompt_routed_experts=ids[:P])


def _batch(samples):
    return TrainBatch.from_sequences([s.prompt_ids for s in samples], [s.response_ids for s in samples])


def test_sample_routes_layout_and_free_last_row():
    s = _sample(3, 4, last_missing=True)
    r = sample_routes(s, LAYOUT)
    assert r.shape == (7, 2, 2) and r.dtype == torch.int64
    assert torch.equal(r[:6], torch.cat([s.prompt_routed_experts, s.routed_experts])[:6].long())
    assert (r[6] == FREE).all()


@pytest.mark.parametrize("mutate, message", [
    (lambda s: setattr(s, "routed_experts", s.routed_experts[:, :1]), "has 1 MoE layers but the trainer's model has 2"),
    (lambda s: setattr(s, "routed_experts", s.routed_experts[..., :1]),
     "top-k 1 but the trainer's model routes to top-k=2"),
    (lambda s: setattr(s, "prompt_routed_experts", s.prompt_routed_experts[:2]),
     "has 2 token rows but the sample has 3 prompt tokens"),
    (lambda s: setattr(s, "prompt_routed_experts", None), "no prompt_routed_experts"),
    (lambda s: s.routed_experts[1].fill_(-1), "no routing for token 4 \\(of P=3 \\+ R=4\\) at MoE layer 0; loss "
                                                  "log-probs depend on the routing of tokens 0..5"),
    (lambda s: s.routed_experts[0, 1].fill_(7), "token 7 has expert ids \\[7, 7\\] outside \\[0, 4\\)"),
    (lambda s: s.routed_experts[0, 0].fill_(2), "token 6 has repeated expert ids \\[2, 2\\]"),
])
def test_sample_routes_misalignment_raises_with_the_numbers(mutate, message):
    s = _sample(3, 4)
    s.routed_experts = s.routed_experts.clone()
    mutate(s)
    with pytest.raises(ValueError, match=message):
        sample_routes(s, LAYOUT, index=5)


def test_routed_experts_token_count_mismatch_is_caught_by_the_sample():
    with pytest.raises(AssertionError):
        _ = Sample(prompt_ids=[1], response_ids=[2, 3], logprobs=[0.0, 0.0], finish_reason="stop",
                   routed_experts=torch.zeros(3, 2, 2, dtype=torch.int32))


def test_attach_routes_pads_free_and_detects_row_order():
    samples = [_sample(3, 4, 0), _sample(5, 2, 1, last_missing=True), _sample(2, 6, 2)]
    batch = attach_routes(_batch(samples), samples, LAYOUT)
    B, S = batch.input_ids.shape
    assert batch.routed_experts.shape == (B, S, 2, 2)
    assert (batch.routed_experts[0, 7:] == FREE).all() and (batch.routed_experts[1, 6] == FREE).all()
    inside = torch.arange(S) < batch.seq_lengths[:, None]
    assert torch.equal(batch.route_checksums, token_checksum(batch.input_ids * inside))
    swapped = [samples[1], samples[0], samples[2]]
    with pytest.raises(ValueError, match="batch row 0 \\(7 tokens\\) does not hold sample 0 \\(7 tokens\\); it holds "
                                         "sample 1: the rows are out of order"):
        attach_routes(_batch(samples), swapped, LAYOUT)
    with pytest.raises(ValueError, match="2 samples for a batch of 3"):
        attach_routes(_batch(samples), samples[:2], LAYOUT)


def test_missing_routes_are_free_where_no_loss_token_depends_on_them():
    aborted = _sample(3, 4, 0)
    aborted.routed_experts = aborted.routed_experts.clone()
    aborted.routed_experts[1:] = -1  # routed up to response token 0 only
    samples = [aborted, _sample(2, 3, 1)]
    batch = _batch(samples)
    with pytest.raises(ValueError, match="sample 0: no routing for token 4"):
        attach_routes(batch, samples, LAYOUT)
    mask = batch.response_mask.clone()
    mask[0, 3:] = False  # loss tokens 0..2 of row 0: predicted from positions 2..4 (P - 1 + j)
    with pytest.raises(ValueError, match="depend on the routing of tokens 0..4"):
        attach_routes(batch.replace(response_mask=mask), samples, LAYOUT)
    mask[0, 2:] = False  # loss tokens 0, 1: positions 2, 3 (routed) decide them
    routed = attach_routes(batch.replace(response_mask=mask), samples, LAYOUT).routed_experts
    assert (routed[0, 4:] == FREE).all() and (routed[0, :4] >= 0).all()
    mask[0] = False
    assert (attach_routes(batch.replace(response_mask=mask), samples, LAYOUT).routed_experts[0, 4:] == FREE).all()


def test_checksums_follow_rows_through_sorted_micro_batches_and_catch_a_shuffle():
    samples = [_sample(2 + i % 3, 1 + (5 * i) % 7, i) for i in range(6)]
    batch = attach_routes(_batch(samples), samples, LAYOUT)
    mbs = make_micro_batches(batch, 2, pad_multiple=4, group_by_length=True)
    assert torch.cat([mb.rows for mb in mbs]).tolist() != list(range(6))  # sorting did reorder the rows
    for mb in mbs:
        check_route_checksums(mb.input_ids, mb.route_checksums)  # sorted and padded: still aligned
        for i, row in enumerate(mb.rows.tolist()):
            n = int(batch.seq_lengths[row])
            assert torch.equal(mb.routed_experts[i, :n], batch.routed_experts[row, :n])
            assert (mb.routed_experts[i, n:] == torch.arange(2)).all()  # padding: valid, distinct ids
    perm = torch.tensor([1, 0, 2, 3, 4, 5])
    shuffled = batch.replace(routed_experts=batch.routed_experts[perm], route_checksums=batch.route_checksums[perm])
    with pytest.raises(ValueError, match="routing replay, micro-batch 0: the routes of row\\(s\\) \\[0, 1\\] were "
                                         "recorded for other token sequences"):
        mb = make_micro_batches(shuffled, 2, group_by_length=False)[0]
        check_route_checksums(mb.input_ids, mb.route_checksums, ", micro-batch 0")


def test_agreement_counts_sets_at_the_predicting_positions():
    samples = [_sample(3, 4, 0), _sample(2, 3, 1)]
    batch = attach_routes(_batch(samples), samples, LAYOUT)
    (mb,) = make_micro_batches(batch, 2, group_by_length=False)
    own = mb.routed_experts.flip(-1).clone()  # same sets, other order: agree everywhere
    own[0, 3, 1] = (own[0, 3, 1] + torch.tensor([1, 1])) % 4  # row 0, position 3 = predicts response token 1
    own[own < 0] = 0
    tracker = AgreementTracker(*batch.response_mask.shape, moe_layers=[0, 2])
    tracker.add(mb, {0: own[:, :, 0].transpose(0, 1).reshape(-1, 2), 2: own[:, :, 1].transpose(0, 1).reshape(-1, 2)})

    class G:
        pp = dp = cp = None

    dis, metrics = tracker.finalize(G())
    changed = not torch.equal(own[0, 3, 1].sort().values, mb.routed_experts[0, 3, 1].sort().values)
    assert metrics["routing/agreement_layer0"] == 1.0
    assert metrics["routing/agreement_layer2"] == pytest.approx(1 - changed / 7)
    assert dis[0, 1].item() == pytest.approx(0.5 * changed) and dis.sum().item() == pytest.approx(0.5 * changed)


def _inputs(disagreement, B=4, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(B, T, generator=g) - 0.5
    lp = mu + 0.05 * torch.randn(B, T, generator=g)
    lp[3] = mu[3] + 2.0  # sequence 3 far off-policy: TRM / masked IS reject it
    return LossInputs(logprobs=lp, mask=torch.ones(B, T, dtype=torch.bool), advantages=torch.randn(B, T, generator=g),
                      rollout_logprobs=mu, routing_disagreement=disagreement)


def test_routing_mask_token_and_sequence_levels():
    d = torch.zeros(4, 5)
    d[0, 2] = 0.5  # one token of sequence 0 disagrees at half the layers
    d[1] = 0.2  # sequence 1 disagrees a little everywhere
    bypass = PolicyLossConfig(mode="bypass")
    tok = select_tokens(_inputs(d), ObjectiveConfig(policy=bypass, routing_mask=RoutingMaskConfig(
        enabled=True, max_disagreement=0.3, level="token")))
    assert tok.keep.sum() == 19 and not tok.keep[0, 2]
    seq = select_tokens(_inputs(d), ObjectiveConfig(policy=bypass, routing_mask=RoutingMaskConfig(
        enabled=True, max_disagreement=0.15, level="sequence")))
    assert seq.seq_keep.tolist() == [True, False, True, True]  # seq 0: mean 0.1 <= 0.15
    with pytest.raises(ValueError, match="routing_disagreement is missing"):
        select_tokens(_inputs(None), ObjectiveConfig(policy=bypass, routing_mask=RoutingMaskConfig(enabled=True)))
    with pytest.raises(ValueError, match="max_disagreement=1.0 must be in"):
        RoutingMaskConfig(max_disagreement=1.0)


@pytest.mark.parametrize("other", [
    dict(trm=TRMConfig(enabled=True, max_kl=0.05, divergence="sample")),
    dict(correction=RolloutCorrectionConfig(is_level="sequence", is_mode="mask", is_lower=0.5, is_upper=2.0)),
])
def test_routing_mask_is_anded_with_trm_and_masked_is(other):
    d = torch.zeros(4, 5)
    d[1] = 0.5
    mask = RoutingMaskConfig(enabled=True, max_disagreement=0.1)
    policy = PolicyLossConfig(mode="bypass", loss="reinforce")
    alone = select_tokens(_inputs(d), ObjectiveConfig(policy=policy, **other))
    both = select_tokens(_inputs(d), ObjectiveConfig(policy=policy, routing_mask=mask, **other))
    assert alone.seq_keep.tolist() == [True, True, True, False]
    assert both.seq_keep.tolist() == [True, False, True, False]
    assert torch.equal(both.keep, alone.keep & torch.tensor([1, 0, 1, 1], dtype=torch.bool)[:, None])
    loss, metrics = rl_loss(_inputs(d), ObjectiveConfig(policy=policy, routing_mask=mask, **other))
    assert metrics["routing_mask/seq_acceptance"].item() == 0.75
    assert metrics["correction/seq_acceptance"].item() == 0.5
    assert metrics["routing_mask/disagreement"].item() == pytest.approx(0.125)
