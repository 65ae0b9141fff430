"""Issue 28 items 4 and 7 on real checkpoints: with ``checkpoints/latest`` deleted, ``resume=true`` continues
from the newest complete ``iter_*`` and keeps the earlier run's metrics lines (it used to warn "holds no
checkpoint", start over and cut metrics.jsonl to 1 line); resuming with another ``data.path`` is one config
error line (exit 2), not a traceback, and changes no file."""

import os

import pytest

from megatron_rl.metrics import read_metrics

from run_helpers import TINY_RECIPE, check_ok, quick_assets, run_cli, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return quick_assets(tmp_path_factory.mktemp("assets"))


def test_resume_without_latest_pointer_then_with_other_data(tmp_path, assets):
    out = tmp_path / "run"
    common = ["checkpoint.interval=1", "eval.interval=0", "checkpoint.save_hf=false"]
    check_ok(run_cli(["train", TINY_RECIPE, *tiny_overrides(assets, out, *common, "stop_after_steps=2",
                                                            steps=3, warmup=3)]))
    before = (out / "metrics.jsonl").read_text()
    assert [m["step"] for m in read_metrics(str(out))] == [1, 2]
    os.remove(out / "checkpoints" / "latest")
    proc = run_cli(["train", TINY_RECIPE, *tiny_overrides(assets, out, *common, "resume=true", steps=3, warmup=3)])
    check_ok(proc)
    assert "resumed from" in proc.stderr and "at step 2" in proc.stderr and "starting a new run" not in proc.stderr
    assert [m["step"] for m in read_metrics(str(out))] == [1, 2, 3]
    assert (out / "metrics.jsonl").read_text().startswith(before)
    after = (out / "metrics.jsonl").read_text()
    other = tiny_overrides(assets, out, *common, "resume=true", f"data.path={assets['eval.jsonl']}", steps=4, warmup=3)
    proc = run_cli(["train", TINY_RECIPE, *other])
    lines = [line for line in proc.stderr.splitlines() if "config error" in line]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert len(lines) == 1 and "resume=true from" in lines[0] and "data.path" in lines[0], lines
    assert (out / "metrics.jsonl").read_text() == after
    assert not (out / ".megatron_rl.lock").exists()  # released by every run, the failed one too
