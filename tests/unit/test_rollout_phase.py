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
from megatron_rl.orchestration.rollout import RolloutPhase, request_seed
from megatron_rl.advantages import AdvantageConfig
from megatron_rl.objectives import ObjectiveConfig
from megatron_rl.rollout.embedded import EmbeddedEngine

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
