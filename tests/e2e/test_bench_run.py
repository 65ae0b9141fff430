"""``megatron-rl bench`` end to end on the tiny recipe: the summary's figures are the run's own ``perf/`` metrics
(same steps, same definitions), the responses have the drawn lengths, and the outputs are there. ``--sweep``
end to end runs as a two-node SLURM job (``tests/distributed/test_slurm_job.py``)."""

import json
import statistics

import pytest

from megatron_rl.metrics import read_metrics
from megatron_rl.plan import calibration

from run_helpers import TINY_RECIPE, check_ok, nontrivial, quick_assets, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _args(assets, *extra):
    return ["bench", TINY_RECIPE, "prepare.kind=none", f"model.hf_path={assets['student']}",
            "rollout.prompts_per_step=4", "bench.prompt_len=fixed:6", *extra, "--steps", "2", "--warmup", "1",
            "--no-progress"]


def _check_point(folder, response_len):
    bench = json.loads((folder / "bench.json").read_text())
    rows = [m for m in read_metrics(str(folder)) if "time/step" in m]
    assert [m["step"] for m in rows] == [1, 2, 3, 4] and bench["timed_steps"] == [2, 3]
    timed = [m for m in rows if m["step"] in (2, 3)]
    for key in ("time/step", "time/rollout", "time/train", "perf/tokens_per_s_per_gpu", "perf/mfu",
                "perf/train_tokens_per_s_per_gpu", "perf/rollout_tokens_per_s_per_gpu", "perf/trainer_idle_frac",
                "sync/seconds"):
        values = [m[key] for m in timed]
        assert bench["stats"][key]["median"] == statistics.median(values), key
        assert bench["stats"][key]["min"] == min(values)
    for m in rows:  # ignore_eos: every response runs to its drawn length; prompts have theirs (BOS included)
        assert m["rollout/response_len_mean"] == response_len and m["rollout/response_len_max"] == response_len
        assert m["rollout/prompt_tokens"] == 6 * 4 * 8
    assert "| tokens/s/GPU |" in (folder / "table.md").read_text() and nontrivial(folder / "phases.png")
    eff = calibration.load(str(folder / "calibration.json"))
    assert eff.source.startswith("calibrated") and eff.rollout_scale > 0 and 2.5 < eff.trainer_passes < 8


def test_bench_reports_the_runs_own_metrics(tmp_path):
    assets = quick_assets(tmp_path / "assets")
    proc = run_cli(_args(assets, "bench.response_len=fixed:5", "--out", str(tmp_path / "one")), timeout=600)
    check_ok(proc)
    assert "| step time (s) |" in proc.stdout
    _check_point(tmp_path / "one", 5)


def test_trainer_and_engine_modes_time_one_side_of_the_step(tmp_path):
    """``--mode engine``: rollouts alone (no trainer pass, no sync), every response its drawn length;
    ``--mode trainer``: train steps on one generated batch (the same tokens every step, no rollout, no sync);
    neither calibrates the planner (its phases are the whole step's)."""
    assets = quick_assets(tmp_path / "assets")
    for mode in ("engine", "trainer"):
        folder = tmp_path / mode
        check_ok(run_cli(_args(assets, "bench.response_len=fixed:5", "--mode", mode, "--out", str(folder)),
                         timeout=600))
        bench = json.loads((folder / "bench.json").read_text())
        rows = [m for m in read_metrics(str(folder)) if "time/step" in m]
        assert [m["step"] for m in rows] == [1, 2, 3, 4] and bench["meta"]["mode"] == mode
        assert not (folder / "calibration.json").exists()
        assert not any(k.startswith("sync/") or k == "time/weight_sync" for m in rows for k in m)
        one_side = ("perf/rollout_tokens_per_s_per_gpu" if mode == "engine" else "perf/train_tokens_per_s_per_gpu")
        values = [m[one_side] for m in rows if m["step"] in (2, 3)]
        assert bench["stats"][one_side]["median"] == statistics.median(values) > 0
        if mode == "engine":
            assert all("time/train" not in m and "time/logprobs" not in m for m in rows)
            assert all(m["rollout/response_len_mean"] == m["rollout/response_len_max"] == 5 for m in rows)
            table = (folder / "table.md").read_text()
            assert "| gen tokens/s per engine |" in table and "| tokens/s/GPU |" not in table  # nothing trained
        else:
            assert all("time/rollout" not in m and "rollout/response_tokens" not in m for m in rows)
            assert {m["train/tokens"] for m in rows} == {4 * 8 * (6 + 5)}  # one batch: 4 prompts x 8 samples
            assert len({m["train/loss"] for m in rows}) > 1  # it trains: the loss moves as the weights do
            assert "| train tokens/s/GPU |" in (folder / "table.md").read_text()
