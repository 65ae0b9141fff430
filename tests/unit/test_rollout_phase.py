"""The driver's rollout phases on a real in-process engine and real reward workers (no Ray, no mocks):
dynamic sampling with over-sampling and its empty-batch edge case, reward failures counted, seeded
reproducibility, batch fitting, and the samples -> TrainBatch -> advantages path."""

import json
import textwrap

import pytest
import torch

from megatron_rl.config import RolloutConfig, SamplingConfig
from megatron_rl.data.config import DataConfig
from megatron_rl.data.prompts import PromptDataset
from megatron_rl.data.rewards import RewardConfig, RewardRunner
from megatron_rl.data.sampler import PromptSampler
from megatron_rl.orchestration.batching import compute_step_advantages, token_rewards, train_batch
from megatron_rl.orchestration.rollout_phase import RolloutPhase, request_seed
from megatron_rl.advantages import AdvantageConfig
from megatron_rl.objectives import ObjectiveConfig
from megatron_rl.rollout.embedded.engine import EmbeddedEngine

from run_helpers import quick_assets

REWARDS = textwrap.dedent("""
    import time

    def by_prompt(response, label, prompt=""):
        if prompt == "1+1=":
            raise RuntimeError("reward blew up")
        if prompt == "2+2=":
            return float("nan")
        if prompt == "3+3=":
            time.sleep(30)  # killed by the timeout
        return 0.5

    def length_parity(response, label):
        return float(len(response) % 2)

    def per_token(response, label, response_ids=()):  # a process reward: one value per response token
        return [((7 * t + j) % 3) / 2 for j, t in enumerate(response_ids)]

    def per_token_too_long(response, label, response_ids=()):
        return [0.0] * (len(response_ids) + 1)
""")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("phase")
    assets = quick_assets(d / "assets")
    (d / "rewards.py").write_text(REWARDS)
    (d / "four.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n"
                                          for i in range(1, 5)))
    from transformers import AutoTokenizer

    return dict(assets=assets, dir=d, engine=EmbeddedEngine.from_pretrained(assets["student"]),
                tokenizer=AutoTokenizer.from_pretrained(assets["student"]))


def _phase(setup, reward: RewardConfig, data_path=None, unit=8, **rollout):
    data = DataConfig(path=str(data_path or setup["assets"]["train.jsonl"]), max_prompt_tokens=16, shuffle=False)
    sampler = PromptSampler.from_config(PromptDataset(data, setup["tokenizer"]))
    cfg = RolloutConfig(sampling=SamplingConfig(max_new_tokens=4), **{"n_samples_per_prompt": 4, **rollout})
    return RolloutPhase(cfg, setup["engine"], setup["tokenizer"], sampler, RewardRunner(reward), seed=7,
                        batch_unit=unit, progress_bars=False)


def test_all_equal_groups_oversample_then_skip_with_a_reason(setup):
    # a random-init policy never answers exactly: every group's rewards are all 0
    phase = _phase(setup, RewardConfig(kind="exact_match", in_process=True), prompts_per_step=4,
                   dynamic_sampling=True, max_oversample_rounds=2)
    batch = phase.collect(step=1, filter_groups=True)
    assert batch.groups == [] and "12 prompt groups in 3 round(s) all had equal rewards" in batch.skipped
    m = batch.metrics
    assert (m["rollout/groups"], m["rollout/groups_kept"], m["rollout/oversample_rounds"]) == (12, 0, 2)
    assert phase.sampler.consumed == 12  # the refill rounds drew new prompts
    # the imitation warm-up does not filter: the same prompts give a full batch
    assert len(phase.collect(step=1, filter_groups=False).groups) == 4


def test_mixed_groups_are_kept_and_fitted_to_the_batch_unit(setup):
    reward = RewardConfig(kind="custom", custom_fn=f"{setup['dir']}/rewards.py:length_parity", in_process=True)
    phase = _phase(setup, reward, prompts_per_step=6, dynamic_sampling=True, max_oversample_rounds=3, unit=8)
    batch = phase.collect(step=3, filter_groups=True)
    assert batch.skipped is None and all(not g.all_equal for g in batch.groups)
    # 4 samples per group, 8-sequence units: an even number of groups, at most prompts_per_step
    assert len(batch.groups) in (2, 4, 6) and batch.metrics["rollout/groups_kept"] == len(batch.groups)
    tb = train_batch(batch.groups)
    assert tb.batch_size == 4 * len(batch.groups) and tb.group_ids.tolist()[:8] == [0] * 4 + [1] * 4
    rewards = [x for g in batch.groups for x in g.rewards]
    r = token_rewards(tb.response_mask, rewards)
    assert torch.equal(r.sum(1), torch.tensor(rewards))  # one reward per sequence, on its last token
    adv, metrics = compute_step_advantages(AdvantageConfig(), ObjectiveConfig(), tb, rewards, None,
                                           imitation_only=False)
    assert adv.shape == tb.response_mask.shape and abs(metrics["adv/mean"]) < 1.0
    zero, _ = compute_step_advantages(AdvantageConfig(), ObjectiveConfig(), tb, rewards, None, imitation_only=True)
    assert not zero.any()


def test_reward_failures_are_counted_and_the_batch_completes(setup):
    reward = RewardConfig(kind="custom", custom_fn=f"{setup['dir']}/rewards.py:by_prompt", timeout_s=1.0,
                          num_workers=2, memory_limit_mb=None, failure_reward=-1.0)
    phase = _phase(setup, reward, data_path=setup["dir"] / "four.jsonl", prompts_per_step=4, n_samples_per_prompt=2)
    try:
        batch = phase.collect(step=1, filter_groups=False)
    finally:
        phase.rewards.close()
    m = batch.metrics
    assert (m["reward/failed_exception"], m["reward/failed_non_finite"], m["reward/failed_timeout"]) == (2, 2, 2)
    assert m["reward/failed"] == 6 and batch.skipped is None
    by_prompt = {g.record.prompt_text: g.rewards for g in batch.groups}
    assert by_prompt["4+4="] == [0.5, 0.5] and by_prompt["1+1="] == [-1.0, -1.0]


def test_seeded_rollouts_are_a_function_of_step_and_slot(setup):
    reward = RewardConfig(kind="exact_match", in_process=True)
    one = _phase(setup, reward, prompts_per_step=2).collect(step=5, filter_groups=False)
    two = _phase(setup, reward, prompts_per_step=2).collect(step=5, filter_groups=False)
    other = _phase(setup, reward, prompts_per_step=2).collect(step=6, filter_groups=False)
    ids = lambda b: [s.response_ids for s in b.samples]  # noqa: E731
    assert ids(one) == ids(two) and ids(one) != ids(other)
    assert request_seed(0, 5, 0, 1) == request_seed(0, 5, 0, 1) != request_seed(0, 5, 1, 1)


def _process_reward(ids):
    return [((7 * t + j) % 3) / 2 for j, t in enumerate(ids)]


def test_per_token_rewards_stay_per_token_end_to_end(setup):
    """§i: a reward function returning one reward per response token (in a worker process) reaches the
    advantages per token: with the return-to-go estimator and its context-only baseline b_t, every r_t is
    recovered from A_t + b_t; the scalar (GRPO) path keeps only a constant per sequence."""
    reward = RewardConfig(kind="custom", custom_fn=f"{setup['dir']}/rewards.py:per_token", num_workers=1,
                          memory_limit_mb=None)
    phase = _phase(setup, reward, prompts_per_step=4)
    try:
        batch = phase.collect(step=2, filter_groups=False)
    finally:
        phase.rewards.close()
    samples = batch.samples
    per_token = [t for g in batch.groups for t in g.token_rewards]
    assert [list(t) for t in per_token] == [_process_reward(s.response_ids) for s in samples]
    assert [x for g in batch.groups for x in g.rewards] == pytest.approx([sum(t) for t in per_token])
    bits = batch.metrics["reward/entropy_bits"]
    assert 0 < bits <= 2.0  # four samples per group: at most log2(4) bits
    tb = train_batch(batch.groups)
    rewards = [x for g in batch.groups for x in g.rewards]
    adv, _ = compute_step_advantages(AdvantageConfig("rtg"), ObjectiveConfig(), tb, rewards, None,
                                     imitation_only=False, per_token=per_token)
    mask = tb.response_mask
    r = token_rewards(mask, rewards, per_token).double()
    G = r.flip(-1).cumsum(-1).flip(-1) * mask
    gid = tb.group_ids
    b = torch.zeros_like(G)  # the group's mean return over the members valid at t: a function of (prompt, t)
    for g in gid.unique():
        rows = gid == g
        b[rows] = (G[rows] * mask[rows]).sum(0) / mask[rows].sum(0).clamp(min=1)
    Gr = torch.where(mask, adv.double() + b, 0.0)
    rec = Gr - torch.cat([Gr[:, 1:], torch.zeros(len(Gr), 1, dtype=Gr.dtype)], 1)
    for i, s in enumerate(samples):
        n = len(s.response_ids)
        torch.testing.assert_close(rec[i, :n], torch.tensor(per_token[i], dtype=rec.dtype), atol=1e-5, rtol=0)
    scalar, _ = compute_step_advantages(AdvantageConfig("grpo", norm_by_std=False), ObjectiveConfig(), tb, rewards,
                                        None, imitation_only=False, per_token=per_token)
    row_const = [bool(torch.all(scalar[i, mask[i]] == scalar[i, mask[i]][0])) for i in range(len(samples))]
    assert all(row_const)  # the scalar path: one number per sequence, the token structure is gone

    bad = RewardConfig(kind="custom", custom_fn=f"{setup['dir']}/rewards.py:per_token_too_long", in_process=True)
    with pytest.raises(ValueError, match="per-token rewards for a response of"):
        _phase(setup, bad, prompts_per_step=1).collect(step=2, filter_groups=False)
