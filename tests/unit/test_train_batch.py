"""Trainer configs, the TrainBatch record, micro-batching and the loss glue, in one process (no Megatron)."""

import math

import pytest
import torch

from megatron_rl.models.config import ModelConfig
from megatron_rl.objectives import (
    AggregationConfig, DenseKLConfig, DVPConfig, KLPenaltyConfig, ObjectiveConfig, PolicyLossConfig,
    RolloutCorrectionConfig, TRMConfig,
)
from megatron_rl.lr_schedules import LRScheduleConfig
from megatron_rl.training import OptimConfig, TrainBatch, TrainConfig, make_micro_batches
from megatron_rl.training import loss_glue
from megatron_rl.training.results import merge_micro_batch_metrics

f64 = torch.float64


# --------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=0.0), "optim.lr"),
    (dict(adam_beta2=1.0), "adam_beta2"),
    (dict(adam_eps=0.0), "adam_eps"),
    (dict(clip_grad=-1.0), "clip_grad"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(lr=1e-5, schedule=LRScheduleConfig(lr=3e-5)), "differs from optim.lr"),
])
def test_optim_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OptimConfig(**kwargs)


def test_optim_config_schedule_takes_the_peak_lr():
    cfg = OptimConfig(lr=3e-4, schedule=LRScheduleConfig(kind="cosine", total_steps=10, warmup_steps=2))
    assert cfg.schedule.lr == 3e-4 and cfg.schedule.kind == "cosine"


@pytest.mark.parametrize("kwargs, match", [
    (dict(micro_batch_size=0), "micro_batch_size"),
    (dict(temperature=0.0), "temperature"),
    (dict(pad_to_multiple=0), "pad_to_multiple"),
    (dict(objective=ObjectiveConfig(dense_kl=DenseKLConfig(beta=0.1))), "reference_model"),
    (dict(objective=ObjectiveConfig(kl_penalty=KLPenaltyConfig(coef=0.1, estimator="exact"))), "reference_model"),
    (dict(objective=ObjectiveConfig(trm=TRMConfig(enabled=True, divergence="exact"))), "divergence='sample'"),
])
def test_train_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs)


def test_train_config_reference_and_dvp_switches():
    cfg = TrainConfig(objective=ObjectiveConfig(dense_kl=DenseKLConfig(beta=0.1)),
                      reference_model=ModelConfig(hf_path="/nowhere"))
    assert cfg.needs_reference_logits and loss_glue.ref_kl_direction(cfg) == "reverse"
    assert TrainConfig(objective=ObjectiveConfig(dvp=DVPConfig(enabled=True, min_p=0.01))).dvp_min_p == 0.01
    assert TrainConfig(objective=ObjectiveConfig(dvp=DVPConfig(enabled=True, rule="top_k"))).dvp_min_p is None


def test_normalizer_needs_current_policy_only_when_selection_reads_it():
    def cfg(**kw):
        return TrainConfig(objective=ObjectiveConfig(**kw))

    bypass = PolicyLossConfig(mode="bypass")
    kept = AggregationConfig(denominator="kept")
    assert not loss_glue.normalizer_needs_current_policy(cfg())
    assert not loss_glue.normalizer_needs_current_policy(cfg(policy=bypass))  # 'total' counts valid tokens
    assert not loss_glue.normalizer_needs_current_policy(cfg(aggregation=kept))  # decoupled: π_old decides
    assert loss_glue.normalizer_needs_current_policy(cfg(policy=bypass, aggregation=kept))
    assert loss_glue.normalizer_needs_current_policy(
        cfg(aggregation=kept, dvp=DVPConfig(enabled=True, out_of_set="mask")))
    assert loss_glue.normalizer_needs_current_policy(cfg(
        policy=PolicyLossConfig(loss="reinforce", mode="bypass"),
        correction=RolloutCorrectionConfig(is_level="token", is_batch_normalize=True)))


# --------------------------------------------------------------------------------------------------
# TrainBatch
# --------------------------------------------------------------------------------------------------


def _batch(B=6, seed=0, vocab=50):
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(1, 5, (B,), generator=g)
    rlen = torch.randint(0, 7, (B,), generator=g)
    prompts = [torch.randint(0, vocab, (int(n),), generator=g) for n in plen]
    responses = [torch.randint(0, vocab, (int(n),), generator=g) for n in rlen]
    batch = TrainBatch.from_sequences(prompts, responses, advantages=[float(i) for i in range(B)],
                                      rollout_logprobs=[-torch.rand(int(n), generator=g) for n in rlen])
    return batch, prompts, responses


def test_from_sequences_aligns_response_fields():
    batch, prompts, responses = _batch()
    for i, (p, r) in enumerate(zip(prompts, responses)):
        n = len(p) + len(r)
        assert batch.input_ids[i, :n].tolist() == p.tolist() + r.tolist()
        assert batch.response_mask[i].sum() == len(r)
        assert torch.all(batch.advantages[i, : len(r)] == float(i))
        assert torch.all(batch.advantages[i, len(r):] == 0)


@pytest.mark.parametrize("change, match", [
    (dict(prompt_lengths=torch.zeros(2, dtype=torch.long)), "prompt_lengths must be >= 1"),
    (dict(response_lengths=torch.tensor([9, 1])), "reach"),
    (dict(advantages=torch.zeros(2, 3)), "advantages must be per-token"),
    (dict(response_mask=torch.ones(3, 4, dtype=torch.bool)), "response_mask"),
    (dict(routed_experts=torch.zeros(2, 6, 2)), "routed_experts"),
    (dict(input_ids=torch.zeros(2, 6)), "int64"),
])
def test_train_batch_rejects_inconsistent_fields(change, match):
    base = dict(input_ids=torch.zeros(2, 6, dtype=torch.long), prompt_lengths=torch.tensor([2, 3]),
                response_lengths=torch.tensor([3, 2]), response_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=match):
        TrainBatch(**{**base, **change})


def test_response_mask_is_clipped_to_the_response_length():
    b = TrainBatch(torch.zeros(1, 6, dtype=torch.long), torch.tensor([2]), torch.tensor([2]),
                   torch.ones(1, 4, dtype=torch.bool))
    assert b.response_mask.tolist() == [[True, True, False, False]]


def test_split_and_select():
    batch, _, _ = _batch(B=6)
    parts = batch.split(3)
    assert [p.batch_size for p in parts] == [2, 2, 2]
    assert torch.equal(parts[1].input_ids, batch.input_ids[2:4])
    with pytest.raises(ValueError, match="equal parts"):
        batch.split(4)


# --------------------------------------------------------------------------------------------------
# Micro-batching
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mbs, match", [(7, "larger than"), (4, "not divisible")])
def test_micro_batch_size_errors(mbs, match):
    batch, _, _ = _batch(B=6)
    with pytest.raises(ValueError, match=match):
        make_micro_batches(batch, mbs)


@pytest.mark.parametrize("group", [True, False])
def test_micro_batches_cover_rows_and_align_targets(group):
    batch, prompts, responses = _batch(B=6, seed=3)
    mbs = make_micro_batches(batch, 2, pad_multiple=4, group_by_length=group)
    assert sorted(torch.cat([m.rows for m in mbs]).tolist()) == list(range(6))
    for m in mbs:
        assert m.seq_length % 4 == 0 and m.seq_length >= int(batch.seq_lengths[m.rows].max())
        for i, row in enumerate(m.rows.tolist()):
            r = responses[row]
            # the logits at flat position logit_index[i, j] predict targets there = response token j
            got = m.targets.reshape(-1)[m.logit_index[i, : len(r)]]
            assert got.tolist() == r.tolist()
            assert m.response_mask[i].sum() == len(r)
            assert torch.equal(m.position_ids[i], torch.arange(m.seq_length))
    same = make_micro_batches(batch, 2, pad_multiple=4, same_length=True)
    assert len({m.seq_length for m in same}) == 1


# --------------------------------------------------------------------------------------------------
# Loss glue (TP = 1): against a float64 log-softmax reference
# --------------------------------------------------------------------------------------------------


def test_token_stats_match_log_softmax_at_response_positions():
    batch, _, responses = _batch(B=4, seed=5, vocab=50)
    (mb,) = make_micro_batches(batch, 4, group_by_length=False)
    g = torch.Generator().manual_seed(0)
    padded_vocab = 64  # columns >= 50 are Megatron's padding: exactly 0, must be ignored
    logits = torch.randn(4, mb.seq_length, padded_vocab, generator=g, dtype=f64) * 3
    logits[..., 50:] = 0.0
    cfg = TrainConfig(micro_batch_size=4, temperature=0.7,
                      objective=ObjectiveConfig(dvp=DVPConfig(enabled=True, min_p=0.05)))
    st = loss_glue.token_stats(logits, mb, cfg, tp_group=None, vocab_size=50)
    logp = torch.log_softmax(logits[..., :50] / 0.7, -1)
    for i, r in enumerate(responses):
        for j, tok in enumerate(r.tolist()):
            row = logp[i, int(batch.prompt_lengths[i]) - 1 + j]
            assert st.full_logprobs[i, j].item() == pytest.approx(row[tok].item(), abs=1e-10)
            assert st.entropy[i, j].item() == pytest.approx(-(row.exp() * row).sum().item(), abs=1e-10)
            assert st.sum_pi_squared[i, j].item() == pytest.approx(row.exp().square().sum().item(), abs=1e-10)
            kept = row >= row.max() + math.log(0.05)
            kept[tok] = True
            assert st.logprobs[i, j].item() == pytest.approx((row[tok] - torch.logsumexp(row[kept], 0)).item(),
                                                             abs=1e-10)


def test_micro_batch_loss_counts_nonfinite_policy_tokens():
    batch, _, _ = _batch(B=2, seed=1)
    batch = batch.replace(old_logprobs=batch.rollout_logprobs)
    (mb,) = make_micro_batches(batch, 2)
    logits = torch.randn(2, mb.seq_length, 50, dtype=f64)
    logits[0] = float("nan")  # a broken forward: the whole first sequence
    cfg = TrainConfig(micro_batch_size=2)
    from megatron_rl.objectives import ReduceGroups, step_normalizer

    norm = step_normalizer([loss_glue.normalizer_inputs(mb, cfg)], cfg.objective)
    _, _, bad = loss_glue.micro_batch_loss(logits, mb, cfg, tp_group=None, vocab_size=50, groups=ReduceGroups(),
                                           normalizer=norm)
    assert int(bad) == int(mb.response_mask[0].sum()) > 0


def test_merge_micro_batch_metrics():
    merged = merge_micro_batch_metrics([
        {"tokens/valid": 10.0, "loss/total": 1.0, "entropy": 2.0, "is/weight_max": 3.0, "is/weight_min": 0.5},
        {"tokens/valid": 30.0, "loss/total": 2.0, "entropy": 4.0, "is/weight_max": 1.0, "is/weight_min": 0.1},
    ])
    assert merged == {"tokens/valid": 40.0, "loss/total": 3.0, "entropy": 3.5, "is/weight_max": 3.0,
                      "is/weight_min": 0.1}
