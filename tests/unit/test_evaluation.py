"""Evaluation: the unbiased pass@k estimator (against enumeration of every k-subset), several datasets
and the ``eval.data`` alias, and ``megatron-rl eval`` stand-alone on the tiny task's models."""

import itertools
import json

import pytest

from megatron_rl.config import EvalConfig
from megatron_rl.config_io import ConfigError, build
from megatron_rl.data.config import DataConfig
from megatron_rl.orchestration.evaluate_model import evaluate, fit_context, markdown_table, resolve
from megatron_rl.orchestration.evaluate import combine, group_metrics, k_values, pass_at_k

from run_helpers import check_ok, quick_assets, run_cli


@pytest.mark.parametrize("n, c", [(5, 0), (5, 2), (6, 5), (4, 4), (7, 3)])
def test_pass_at_k_is_the_mean_over_all_k_subsets(n, c):
    passes = [1] * c + [0] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(passes, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_group_metrics_and_combined_datasets():
    assert k_values(1) == [1] and k_values(8) == [1, 2, 4, 8] and k_values(6) == [1, 2, 4, 6]
    a = group_metrics([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]], [2] * 8, k=4, threshold=1.0)
    assert a["mean@4"] == a["reward_mean"] == pytest.approx(5 / 8)
    assert a["pass@1"] == pytest.approx((0.25 + 1) / 2) and a["pass@4"] == 1.0
    assert a["pass@2"] == pytest.approx((0.5 + 1) / 2)  # 1 − C(3,2)/C(4,2) = 1/2
    b = group_metrics([[0.5, 0.0, 0.0, 0.0]], [3] * 4, k=4, threshold=0.5)
    both = combine({"a": dict(a, reward_failed=1.0), "b": dict(b, reward_failed=2.0)})
    assert both["eval/prompts"] == 3 and both["eval/reward_failed"] == 3
    assert both["eval/pass@1"] == pytest.approx((2 * a["pass@1"] + b["pass@1"]) / 3)
    assert both["eval/a/pass@1"] == a["pass@1"] and both["eval/b/mean@4"] == pytest.approx(0.125)
    one = combine({"eval": dict(a, reward_failed=0.0)})
    assert "eval/reward_mean" in one and not any(k.startswith("eval/eval/") for k in one)


def test_eval_config_alias_and_checks(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cfg = build(EvalConfig, {"data": {"path": str(data)}})
    assert list(cfg.named_datasets) == ["eval"] and cfg.samples_per_prompt == 1
    cfg = build(EvalConfig, {"datasets": {"x": {"path": str(data)}, "y": {"path": str(data)}}, "k": 4, "n_samples": 6})
    assert isinstance(cfg.named_datasets["y"], DataConfig) and cfg.samples_per_prompt == 6
    for bad, msg in (({"data": {"path": str(data)}, "datasets": {"x": {"path": str(data)}}}, "both set"),
                     ({"k": 4, "n_samples": 2}, "n >= k"), ({"k": 2, "greedy": True}, "greedy samples are all the same"),
                     ({"datasets": {"x": {"path": str(tmp_path / "missing.jsonl")}}}, "eval.datasets.x")):
        with pytest.raises(ConfigError, match=msg):
            build(EvalConfig, bad, "eval")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return quick_assets(tmp_path_factory.mktemp("eval_assets"))


def test_standalone_eval_of_an_hf_dir_with_two_datasets(assets, tmp_path):
    """The fine-tuned teacher vs the random student on the tiny task, two datasets, k = 4."""
    evens = tmp_path / "evens.jsonl"
    rows = [json.loads(line) for line in open(assets["eval.jsonl"])]
    evens.write_text("".join(json.dumps(r) + "\n" for r in rows[::2][:20]))
    over = [f"eval.datasets.all.path={assets['eval.jsonl']}", "eval.datasets.all.max_prompt_tokens=16",
            f"eval.datasets.evens.path={evens}", "eval.datasets.evens.max_prompt_tokens=16", "eval.max_prompts=40",
            "eval.k=4", "reward.kind=exact_match", "reward.in_process=true", "rollout.sampling.max_new_tokens=4"]
    teacher = evaluate(resolve(assets["teacher"], over), progress=False)
    student = evaluate(resolve(assets["teacher"], over, model=assets["student"]), progress=False)
    assert list(teacher) == ["all", "evens"] and teacher["evens"]["prompts"] == 20
    for m in (teacher["all"], student["all"]):
        assert 0 <= m["pass@1"] <= m["pass@2"] <= m["pass@4"] <= 1
        assert m["pass@1"] == pytest.approx(m["mean@4"])  # a 0/1 reward: pass@1 is the mean reward
    # 20 fine-tune steps make a difference (and --model is the model evaluated)
    assert teacher["all"]["pass@4"] > student["all"]["pass@4"] and teacher["all"]["pass@4"] > teacher["all"]["pass@1"]
    assert "| all | 40 |" in markdown_table(teacher)
    with pytest.raises(ConfigError, match="nothing to evaluate"):
        resolve(assets["teacher"], ["reward.kind=exact_match"])
    with pytest.raises(ConfigError, match="takes eval"):
        resolve(assets["teacher"], ["optim.lr=1"])


def test_eval_cli_writes_json(assets, tmp_path):
    out = tmp_path / "res.json"
    proc = run_cli(["eval", assets["teacher"], f"eval.data.path={assets['eval.jsonl']}", "eval.data.max_prompt_tokens=16",
                    "eval.max_prompts=16", "eval.k=2", "reward.kind=exact_match", "reward.in_process=true",
                    "rollout.sampling.max_new_tokens=4", "--output", str(out)])
    check_ok(proc)
    res = json.loads(out.read_text())
    assert res["k"] == 2 and set(res["datasets"]["eval"]) >= {"pass@1", "pass@2", "mean@2"}
    assert "| eval | 16 |" in proc.stdout


def test_eval_fits_the_context_and_refuses_empty_data_cleanly(assets, tmp_path):
    """The tiny models have 64 positions: prompts that leave no room for max_new_tokens are left out (said on
    stderr when some are) rather than rejected by the engine mid-run; an empty file is a ConfigError (exit 2), no traceback."""
    over = [f"eval.data.path={assets['eval.jsonl']}", "reward.kind=exact_match", "rollout.sampling.max_new_tokens=24"]
    fitted = fit_context(resolve(assets["teacher"], over))
    assert fitted["eval"].max_prompt_tokens == 64 - 24
    with pytest.raises(ConfigError, match="max_new_tokens=64 leaves no room"):
        fit_context(resolve(assets["teacher"], over + ["rollout.sampling.max_new_tokens=64"]))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="has no rows"):
        evaluate(resolve(assets["teacher"], [f"eval.data.path={empty}", "reward.kind=exact_match",
                                           "rollout.sampling.max_new_tokens=4"]), progress=False)
