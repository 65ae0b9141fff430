"""End-to-end asynchronous RL on the tiny recipe (real Ray actors, 2 Megatron TP ranks, the embedded engine behind
the SGLang-compatible server, disaggregated): ``rollout.mode=async``.

* without partial rollouts, seeded: the run is reproducible run to run (steps 1-2 of two separate processes
  are equal) and resumes exactly (steps 3-4 after a stop at step 2 equal the uninterrupted run's, with the
  groups that were generating at the checkpoint regenerated);
* with partial rollouts and max_staleness=2: every step's tokens respect the bound, and a resumed run goes on
  (regenerating what was in flight).
"""

import math

import pytest

from megatron_rl.metrics import WALL_CLOCK, read_metrics

from run_helpers import TINY_RECIPE, check_ok, quick_assets, run_cli, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
_TIMING = WALL_CLOCK
_ASYNC = ["rollout.mode=async", "rollout.placement=disaggregated", "eval.interval=0", "checkpoint.save_hf=false",
          "checkpoint.interval=1"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return quick_assets(tmp_path_factory.mktemp("assets"))


def _run(assets, out, *extra, steps=4):
    # warm-up steps only: no dynamic-sampling filter, so every step trains
    check_ok(run_cli(["train", TINY_RECIPE, *tiny_overrides(assets, out, *_ASYNC, *extra, steps=steps, warmup=steps)],
                     timeout=900))
    return read_metrics(str(out))


def _same(a, b):
    keys = {k for k in a if not k.startswith(_TIMING)}
    assert keys == {k for k in b if not k.startswith(_TIMING)}, a["step"]
    for k in keys:
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (a["step"], k, a[k], b[k])


def test_async_is_reproducible_and_resumes_exactly(tmp_path, assets):
    full = _run(assets, tmp_path / "full")
    assert [m["step"] for m in full] == [1, 2, 3, 4]
    # step 1 trains on the initial weights' samples; then max_staleness=1: one version behind
    assert [m["rollout/staleness_max"] for m in full] == [0.0, 1.0, 1.0, 1.0]
    assert all(m["rollout/staleness_frac_0"] + m["rollout/staleness_frac_1"] == 1.0 for m in full)
    assert all(m["rollout/partial_frac"] == 0.0 and m["versions/spanning_token_frac"] == 0.0 for m in full)
    assert all(0.0 <= m["perf/engine_idle_frac"] <= 1.0 and 0.0 <= m["perf/trainer_idle_frac"] <= 1.0 for m in full)
    assert all(math.isfinite(m["train/loss"]) for m in full) and full[-1]["train/optimizer_step"] == 4.0
    split = _run(assets, tmp_path / "split", "stop_after_steps=2")
    for a, b in zip(full[:2], split):  # two processes, different timings, the same run
        _same(a, b)
    resumed = _run(assets, tmp_path / "split", "resume=true")
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for a, b in zip(full, resumed):
        _same(a, b)


def test_partial_rollouts_keep_the_bound_and_resume(tmp_path, assets):
    extra = ["rollout.partial=true", "rollout.max_staleness=2", "rollout.sampling.max_new_tokens=24"]
    out = tmp_path / "partial"
    first = _run(assets, out, *extra, "stop_after_steps=2")
    lines = _run(assets, out, *extra, "resume=true")
    assert [m["step"] for m in first] == [1, 2] and [m["step"] for m in lines] == [1, 2, 3, 4]
    for m in lines:
        assert m["rollout/staleness_max"] <= 2.0 and m["rollout/staleness_mean"] <= m["rollout/staleness_max"]
        assert sum(m[f"rollout/staleness_frac_{j}"] for j in range(3)) == pytest.approx(1.0)
        assert 0.0 <= m["rollout/partial_frac"] <= 1.0 and math.isfinite(m["train/loss"])
        assert m["sync/flush_refused"] == 0.0  # the retract pause lets every sync flush the prefix cache (N1)
    assert lines[-1]["train/optimizer_step"] == 4.0
