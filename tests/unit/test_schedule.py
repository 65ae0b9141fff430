"""The token-budget scheduler: the cap is a hard cap, every sequence lands exactly once, all data-parallel
ranks run the same number of micro-batches, the plan is deterministic, and the estimated work stays
balanced over ranks on adversarial length sets (bound: max rank work <= mean + the largest sequence's)."""

import random

import pytest
import torch

from megatron_rl.training.token_budget import WorkModel, assign_to_ranks, imbalance, pack, rank_rows

WORK = WorkModel(a=1.0, b=0.02)


def _lengths(kind: str, n: int, seed: int = 0):
    rng = random.Random(seed)
    if kind == "lognormal":  # RL's long tail: mean/max ~ 0.25
        return [min(1024, max(4, int(rng.lognormvariate(4.5, 0.8)))) for _ in range(n)]
    if kind == "one_giant":
        return [1000] + [4] * (n - 1)
    if kind == "equal":
        return [64] * n
    if kind == "two_modes":
        return [rng.choice([8, 900]) for _ in range(n)]
    if kind == "geometric":
        return [max(1, int(1000 * 0.8 ** i)) for i in range(n)]
    raise ValueError(kind)


def _plan(lengths, dp, cap, multiple=1):
    """What the driver and the trainer do: work-balanced ranks, then per rank the smallest packing, the
    largest count over ranks, every rank packed into exactly that many micro-batches."""
    work = WORK(lengths)
    ranks = assign_to_ranks(work, dp)
    counts = [len(pack([lengths[i] for i in r], [work[i] for i in r], cap, multiple=multiple)) for r in ranks]
    m = max(counts)
    return ranks, [pack([lengths[i] for i in r], [work[i] for i in r], cap, multiple=multiple, count=m) for r in ranks]


@pytest.mark.parametrize("kind", ["lognormal", "one_giant", "equal", "two_modes", "geometric"])
@pytest.mark.parametrize("dp, cap, multiple", [(1, 1024, 1), (2, 1500, 1), (4, 1024, 8), (3, 2048, 4)])
def test_cap_coverage_equal_counts_determinism_and_balance(kind, dp, cap, multiple):
    lengths = _lengths(kind, 48, seed=dp)
    ranks, plans = _plan(lengths, dp, cap, multiple)
    assert _plan(lengths, dp, cap, multiple) == (ranks, plans)  # deterministic
    assert sorted(i for r in ranks for i in r) == list(range(len(lengths)))  # each sequence on one rank
    assert len({len(r) for r in ranks}) == 1  # equal sequence counts per rank (48 divisible by dp)
    assert len({len(p) for p in plans}) == 1  # equal micro-batch counts per rank
    for r, plan in zip(ranks, plans):
        assert sorted(j for mb in plan for j in mb) == list(range(len(r)))  # every sequence exactly once
        for mb in plan:
            assert mb  # no empty micro-batch
            total = sum(lengths[r[j]] for j in mb)
            assert -(-total // multiple) * multiple <= cap  # the cap, after rounding the stream up
    work = WORK(lengths)
    loads = [sum(work[i] for i in r) for r in ranks]
    mean = sum(loads) / dp
    assert max(loads) <= mean + max(work) + 1e-9, (loads, max(work))
    if kind != "two_modes":  # (there, which rank gets one more of the few long sequences decides)
        # no assignment with equal counts beats the mean, nor the largest sequence plus the smallest ones it
        # must share its rank with: within 5 % of that lower bound
        share = len(lengths) // dp
        bound = max(mean, max(work) + sum(sorted(work)[: share - 1]))
        assert max(loads) <= 1.05 * bound, (loads, bound)


def test_packing_beats_the_fixed_count_and_balances_micro_batches():
    lengths = _lengths("lognormal", 64)
    plan = pack(lengths, WORK(lengths), 2048)
    assert len(plan) == -(-sum(lengths) // 2048) or len(plan) == -(-sum(lengths) // 2048) + 1  # near the bound
    w = WORK(lengths)
    loads = [sum(w[i] for i in mb) for mb in plan]
    assert imbalance(loads) < 1.2


def test_forced_count_splits_when_greedy_cannot_fill_it():
    lengths = [10, 10, 10, 10, 1, 1]
    plan = pack(lengths, WORK(lengths), 20, count=5)
    assert len(plan) == 5 and all(plan) and sorted(j for mb in plan for j in mb) == list(range(6))
    assert all(sum(lengths[j] for j in mb) <= 20 for mb in plan)
    with pytest.raises(ValueError, match="cannot cut 6 sequences into exactly 7 micro-batches"):
        pack(lengths, WORK(lengths), 20, count=7)


def test_a_sequence_longer_than_the_cap_names_length_cap_and_fix():
    with pytest.raises(ValueError, match=r"a sequence of 300 tokens does not fit train.max_tokens_per_micro_batch=256;"
                                         r" raise train.max_tokens_per_micro_batch to at least 300 or use context "
                                         r"parallelism \(parallel.cp\)"):
        pack([10, 300, 20], [1.0, 1.0, 1.0], 256)
    with pytest.raises(ValueError, match=r"does not fit train.forward_max_tokens_per_micro_batch=100 \(x parallel.cp="
                                         r"2 = 200 tokens per micro-batch\); raise .* to at least 150 or raise "
                                         r"parallel.cp"):
        pack([300], [1.0], 200, cp=2, field="train.forward_max_tokens_per_micro_batch")


def test_rank_rows_balanced_or_contiguous():
    lengths = torch.tensor([100, 1, 1, 1, 90, 2, 3, 80])
    assert [r.tolist() for r in rank_rows(lengths, 2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    rows = rank_rows(lengths, 2, WORK)
    assert sorted(torch.cat(rows).tolist()) == list(range(8)) and [len(r) for r in rows] == [4, 4]
    loads = [sum(WORK(lengths[r].tolist())) for r in rows]
    assert imbalance(loads) < imbalance([sum(WORK(lengths[:4].tolist())), sum(WORK(lengths[4:].tolist()))])


def test_work_model_from_arch_counts_attention_quadratically():
    from megatron_rl.models.config import HFArch
    from transformers import Qwen3Config

    arch = HFArch.from_hf(Qwen3Config(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, intermediate_size=96))
    w = WorkModel.from_arch(arch)
    # per token: 2 x (layers x (q, k, v, o + 3 MLP matrices) + output layer); per pair: 2 x layers x heads x head_dim
    assert w.a == 2 * (2 * (64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 96) + 64 * 1000)
    assert w.b == 2 * 2 * 64
    assert w([10])[0] == pytest.approx(10 * w.a + 100 * w.b)


def test_driver_split_and_reassembly_keep_batch_order():
    """The driver's work-balanced DP split (not contiguous) and its reassembly of per-rank forward results:
    every row of the result belongs to the same batch row (old log-probs must never shift between samples)."""
    from megatron_rl.orchestration.trainer_group import _concat_forward
    from megatron_rl.training import ForwardResult, TrainBatch

    lengths = [30, 2, 3, 25, 4, 28, 1, 5]
    batch = TrainBatch.from_sequences([[7]] * 8, [list(range(n)) for n in lengths])
    rows = rank_rows(batch.seq_lengths, 2, WORK)
    assert torch.cat(rows).tolist() != list(range(8))  # balanced: not the contiguous split
    parts = []
    for r in rows:  # each rank answers for its shard: a value that names the batch row
        shard = batch.select(r)
        tag = shard.response_lengths.float()[:, None].expand_as(shard.response_mask).clone()
        parts.append(ForwardResult(logprobs=tag, entropy=tag, sum_pi_squared=tag, response_mask=shard.response_mask))
    merged = _concat_forward(parts, torch.argsort(torch.cat(rows)))
    assert torch.equal(merged.logprobs[:, 0], batch.response_lengths.float())
    assert torch.equal(merged.response_mask, batch.response_mask)
