"""Issue 28 item 3: a label column of mixed types keeps each value's type (``"02"`` stays a string, ``4`` an int,
``["6"]`` a list), and exact_match says once, loudly, when a label is a type it cannot compare."""

from __future__ import annotations

import json
import logging

import pytest
from transformers import AutoTokenizer

from megatron_rl.data import DataConfig
from megatron_rl.data.prompts import PromptDataset
from megatron_rl.data.rewards import RewardConfig
from megatron_rl.data.rewards.runner import RewardRunner
from megatron_rl.data.tiny_tokenizer import make_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    make_tiny_tokenizer(d)
    return AutoTokenizer.from_pretrained(d)


def _dataset(tmp_path, tokenizer, labels, **extra):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": a, **extra}) + "\n"
                            for i, a in enumerate(labels)))
    config = DataConfig(path=str(path), label_field="answer", cache_dir=str(tmp_path / "cache"), shuffle=False)
    return PromptDataset(config, tokenizer)


def test_mixed_label_column_keeps_each_type(tmp_path, tokenizer):
    labels = ["02", 4, ["6"], "7", None, 1.5, {"a": "1"}]
    ds = _dataset(tmp_path, tokenizer, labels)
    got = [r.label for r in ds.records(range(len(ds)))]
    assert got == labels and [type(g) for g in got] == [type(x) for x in labels]
    # exact match against the string "02": the response "02" matches, "2" does not
    with RewardRunner(RewardConfig(kind="exact_match", in_process=True)) as runner:
        rewards = runner.compute_rewards(["02", "2"], [got[0], got[0]]).rewards
    assert list(rewards) == [1.0, 0.0]


def test_uniform_columns_are_unchanged(tmp_path, tokenizer):
    ds = _dataset(tmp_path, tokenizer, ["02", "4", "10"])
    assert [r.label for r in ds.records(range(3))] == ["02", "4", "10"]


def test_list_label_is_said_once_loudly(caplog):
    with RewardRunner(RewardConfig(kind="exact_match", in_process=True)) as runner, \
            caplog.at_level(logging.WARNING), pytest.warns(UserWarning, match="REWARD CANNOT COMPARE LABELS"):
        runner.compute_rewards(["2", "2", "2"], [["2"], "2", ["3"]])
        runner.compute_rewards(["2"], [["2"]])  # the same type again: not repeated
    said = [r for r in caplog.records if "REWARD CANNOT COMPARE LABELS" in r.getMessage()]
    assert len(said) == 1 and "2 of this batch's 3 labels are a list" in said[0].getMessage()


def test_custom_reward_gets_no_warning(caplog, tmp_path):
    fn = tmp_path / "r.py"
    fn.write_text("def reward(response, label):\n    return float(label == [response])\n")
    with RewardRunner(RewardConfig(kind="custom", custom_fn=f"{fn}:reward", in_process=True)) as runner, \
            caplog.at_level(logging.WARNING):
        assert list(runner.compute_rewards(["2"], [["2"]]).rewards) == [1.0]
    assert not [r for r in caplog.records if "CANNOT COMPARE" in r.getMessage()]
