"""Issue 28 items 4 and 7 on real checkpoints: with ``checkpoints/latest`` deleted, ``resume=true`` finds the
newest complete ``iter_*`` itself (it used to warn "holds no checkpoint", start over and cut metrics.jsonl to 1
line); resuming it with another ``data.path`` is one config error line (exit 2) naming that checkpoint, not a
traceback, and changes no file. Two short runs (the second stops once the checkpoint is loaded)."""

import os

import pytest

from megatron_rl.metrics import read_metrics

from run_helpers import TINY_RECIPE, check_ok, quick_assets, run_cli, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return quick_assets(tmp_path_factory.mktemp("assets"))


def test_resume_without_latest_pointer_finds_the_checkpoint_and_other_data_is_one_line(tmp_path, assets):
    out = tmp_path / "run"
    common = ["checkpoint.interval=1", "eval.interval=0", "checkpoint.save_hf=false"]
    check_ok(run_cli(["train", TINY_RECIPE, *tiny_overrides(assets, out, *common, steps=2, warmup=2)]))
    before = (out / "metrics.jsonl").read_text()
    assert [m["step"] for m in read_metrics(str(out))] == [1, 2]
    os.remove(out / "checkpoints" / "latest")
    other = tiny_overrides(assets, out, *common, "resume=true", f"data.path={assets['eval.jsonl']}", steps=3, warmup=2)
    proc = run_cli(["train", TINY_RECIPE, *other])
    lines = [line for line in proc.stderr.splitlines() if "config error" in line]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert len(lines) == 1 and "resume=true from" in lines[0] and "iter_0000002" in lines[0], lines
    assert "data.path" in lines[0] and "starting a new run" not in proc.stderr, lines
    assert (out / "metrics.jsonl").read_text() == before
    assert not (out / ".megatron_rl.lock").exists()  # released by both runs, the failed one too
