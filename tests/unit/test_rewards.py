"""Rewards: math-verify, exact match, custom functions, and the worker runner's failure handling
(exception, timeout, NaN, memory limit, dead worker) — real worker processes, no mocks."""

import textwrap
import time

import pytest

from megatron_rl.data.arithmetic import all_problems
from megatron_rl.data.rewards import (
    ExactMatchOptions, RewardConfig, RewardRunner, exact_match_reward, load_custom_fn, math_reward)

# A custom reward whose behaviour is picked by the response text, to provoke every failure kind.
CUSTOM_SOURCE = textwrap.dedent("""
    import os, resource, time

    def reward(response, label, weight=1.0):
        if response == "limit":  # the address-space cap the worker runs under, in MiB
            return resource.getrlimit(resource.RLIMIT_AS)[0] / 2**20
        if response == "raise":
            raise RuntimeError("reward blew up")
        if response == "sleep":
            time.sleep(60)
        if response == "nan":
            return float("nan")
        if response == "alloc":
            return len(bytearray(4 << 30))  # 4 GiB, far past the 512 MiB limit below
        if response == "exit":
            os._exit(3)
        if response == "huge":  # finite in float64, inf as the float32 advantage it becomes
            return 1e300
        if response == "string":
            return "1.0"
        return weight * float(response.strip() == label)

    NOT_CALLABLE = 3

    def wrong_arity(response):
        return 0.0
""")


@pytest.fixture(scope="module")
def custom_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("custom") / "my_rewards.py"
    path.write_text(CUSTOM_SOURCE)
    return path


# -- built-in rewards (in-process: they are pure functions) --------------------------------------


@pytest.mark.parametrize("response,label,expected", [
    ("so the answer is \\boxed{1/2}", "0.5", 1.0),
    ("\\boxed{\\frac{1}{2}}", "1/2", 1.0),
    ("0.5", "\\frac{1}{2}", 1.0),
    ("The sum is 18.", "18", 1.0),
    ("\\boxed{8}", "7", 0.0),
    ("I don't know", "7", 0.0),
    ("\\boxed{0.49}", "1/2", 0.0),
])
def test_math_reward(response, label, expected):
    assert math_reward(response, label) == expected


def test_math_reward_unparseable_gold_raises():
    with pytest.raises(ValueError, match="could not parse the gold answer"):
        math_reward("7", "")


def test_exact_match_options():
    assert exact_match_reward("  7 \n", "7") == 1.0
    assert exact_match_reward("a   b", "a b") == 1.0
    assert exact_match_reward("A b", "a B") == 0.0
    assert exact_match_reward("A b", "a B", options=ExactMatchOptions(ignore_case=True)) == 1.0
    assert exact_match_reward(" 7", "7", options=ExactMatchOptions(strip=False)) == 0.0
    assert exact_match_reward("18", 18) == 1.0  # labels are compared as strings


def test_arithmetic_task_reward_right_and_wrong():
    rows = all_problems()
    answers = [r["answer"] for r in rows]
    with RewardRunner(RewardConfig(kind="exact_match", in_process=True)) as runner:
        right = runner.compute_rewards(answers, answers)
        wrong = runner.compute_rewards([str(int(a) + 1) for a in answers], answers)
        unstopped = runner.compute_rewards([a + "+1" for a in answers], answers)
    assert right.rewards == [1.0] * 100 and not any(right.failed)
    assert wrong.rewards == [0.0] * 100 and unstopped.rewards == [0.0] * 100
    assert right.stats["reward/mean"] == 1.0


# -- custom functions ----------------------------------------------------------------------------


def test_custom_function_resolution_errors(custom_file):
    assert load_custom_fn(f"{custom_file}:reward")("7", "7") == 1.0
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        load_custom_fn("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match=r"has no attribute 'nope'; callables there: \['reward', 'wrong_arity'\]"):
        load_custom_fn(f"{custom_file}:nope")
    with pytest.raises(ValueError, match="'NOT_CALLABLE' is a int, not callable"):
        load_custom_fn(f"{custom_file}:NOT_CALLABLE")
    with pytest.raises(ValueError, match="cannot be called as fn\\(response_text, label"):
        load_custom_fn(f"{custom_file}:wrong_arity")
    with pytest.raises(ValueError, match="does not exist"):
        load_custom_fn("/no/such/file.py:reward")
    with pytest.raises(ValueError, match="kind='custom' needs 'package.module:function'"):
        RewardConfig(kind="custom", custom_fn="my_rewards.reward")
    with pytest.raises(ValueError, match="no_such_module_xyz"):  # the runner resolves up front, in the caller
        RewardRunner(RewardConfig(kind="custom", custom_fn="no_such_module_xyz:fn"))


def test_custom_module_function_in_worker_with_sample_info(custom_file, monkeypatch):
    monkeypatch.syspath_prepend(str(custom_file.parent))  # the worker must see the caller's sys.path
    cfg = RewardConfig(kind="custom", custom_fn="my_rewards:reward", num_workers=1, timeout_s=20)
    with RewardRunner(cfg) as runner:
        # `weight` is accepted by the function and passed; `unused` is not, and is filtered out.
        res = runner.compute_rewards(["7", "7", "8"], ["7", "7", "7"],
                                     [{"weight": 2.0}, {"unused": 1}, {"weight": 2.0}])
    assert res.rewards == [2.0, 1.0, 0.0] and not any(res.failed)


def test_config_validation():
    with pytest.raises(ValueError, match="reward.kind='regex'"):
        RewardConfig(kind="regex")
    with pytest.raises(ValueError, match="reward.timeout_s=0"):
        RewardConfig(timeout_s=0)
    with pytest.raises(ValueError, match=r"reward.timeout_s=5 cannot be enforced with reward.in_process=true"):
        RewardConfig(kind="exact_match", in_process=True, timeout_s=5)
    assert RewardConfig(in_process=True).timeout_s is None and RewardConfig().worker_timeout_s == 10.0
    with pytest.raises(ValueError, match="reward.memory_limit_mb=64"):
        RewardConfig(memory_limit_mb=64)
    with pytest.raises(ValueError, match="custom_fn='m:f' is set but reward.kind='math'"):
        RewardConfig(custom_fn="m:f")
    with pytest.raises(ValueError, match="failure_reward=nan"):
        RewardConfig(failure_reward=float("nan"))
    with pytest.raises(ValueError, match="2 labels"):
        RewardRunner(RewardConfig(kind="exact_match", in_process=True)).compute_rewards(["a"], ["a", "b"])


# -- worker runner: failures are counted, never raised --------------------------------------------


def test_worker_failures_marked_and_batch_completes(custom_file, caplog):
    cfg = RewardConfig(kind="custom", custom_fn=f"{custom_file}:reward", timeout_s=1.5, num_workers=2,
                       memory_limit_mb=512, failure_reward=-1.0)
    with RewardRunner(cfg) as runner:
        warm = runner.compute_rewards(["7", "8", "limit"], ["7", "7", "7"])  # start workers: time only failures
        assert warm.rewards == [1.0, 0.0, 512.0]
        responses = ["7", "raise", "sleep", "nan", "alloc", "exit", "8", "7", "huge", "string"]
        start = time.monotonic()
        res = runner.compute_rewards(responses, ["7"] * len(responses))
        elapsed = time.monotonic() - start
        after = runner.compute_rewards(["7"] * 4, ["7"] * 4)  # replaced workers serve the next batch
    assert elapsed < cfg.timeout_s + 4.0, elapsed  # bounded by the timeout, not the 60 s sleep
    assert res.failed == [False, True, True, True, True, True, False, False, True, True]
    assert res.rewards == [1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 0.0, 1.0, -1.0, -1.0]
    reasons = res.reasons
    assert reasons[0] is None and reasons[6] is None
    assert reasons[1] == "exception: RuntimeError: reward blew up"
    assert reasons[2].startswith("timeout: reward did not finish within reward.timeout_s=1.5 s")
    assert reasons[3] == "non_finite: reward function returned nan"
    assert reasons[4] == "exception: MemoryError (over reward.memory_limit_mb=512)"
    assert reasons[5] == "worker_died: reward worker died (exit code 3) while scoring"
    assert reasons[8] == "non_finite: reward function returned 1e+300, beyond float32 (|r| <= 3.4e+38)"
    assert reasons[9] == "exception: TypeError: the reward function returned str '1.0', not a number"
    s = res.stats
    assert (s["reward/failed"], s["reward/failed_exception"], s["reward/failed_timeout"],
            s["reward/failed_non_finite"], s["reward/failed_worker_died"]) == (7, 3, 1, 2, 1)
    assert s["reward/worker_restarts"] == 2
    assert after.rewards == [1.0] * 4 and not any(after.failed)
    assert runner.total_samples == 17 and runner.total_failed == 7
    assert any("7 of 10 rewards failed" in r.getMessage() for r in caplog.records)


def test_math_reward_in_workers():
    with RewardRunner(RewardConfig(kind="math", num_workers=1, timeout_s=20)) as runner:
        res = runner.compute_rewards(["\\boxed{1/2}", "0.4", "7"], ["0.5", "0.5", ""])
    assert res.rewards == [1.0, 0.0, 0.0]
    assert res.failed == [False, False, True] and "could not parse the gold answer" in res.reasons[2]


def test_in_process_failures_marked(custom_file):
    cfg = RewardConfig(kind="custom", custom_fn=f"{custom_file}:reward", in_process=True, failure_reward=0.0)
    res = RewardRunner(cfg).compute_rewards(["raise", "nan", "7", "huge", "string"], ["7"] * 5)
    assert res.rewards == [0.0, 0.0, 1.0, 0.0, 0.0] and res.failed == [True, True, False, True, True]
    assert res.reasons[:2] == ["exception: RuntimeError: reward blew up", "non_finite: reward function returned nan"]
    assert res.reasons[3:] == ["non_finite: reward function returned 1e+300, beyond float32 (|r| <= 3.4e+38)",
                               "exception: TypeError: the reward function returned str '1.0', not a number"]
    assert res.stats["reward/failed_non_finite"] == 2.0
    # numpy / torch scalars are numbers
    import numpy as np
    import torch

    from megatron_rl.data.rewards.builtin import reward_value
    assert reward_value(np.float32(0.5)) == 0.5 and reward_value(torch.tensor(2.0)) == 2.0 and reward_value(True) == 1.0
    assert reward_value([1, np.float64(0.5)]) == (1.0, 0.5)  # per-token rewards
    with pytest.raises(TypeError, match="dict"):
        reward_value({"r": 1.0})
    with pytest.raises(TypeError, match="str '1'"):
        reward_value([0.0, "1"])
