"""Reliability of ``megatron-rl train`` on the tiny recipe (issue 16), through ``tools/chaos.py``:

* bad inputs: every case of ``chaos.BAD_INPUTS`` (types, values, data files, model files, custom rewards, output
  directories, resume pointers, remote servers, what only a start can tell) ends with exit 2 and one line per
  problem naming the field or file, never a traceback, and leaves a previous run's files as they were;
* the rollout server's bad requests (``chaos.INPUT_CLASSES['rollout server']``, issue 28): each a 4xx with a
  message or a valid 2xx, while another client's request still answers 200;
* a cold GRPO start whose first steps have no signal (dynamic sampling drops every group): it checkpoints before
  any optimizer step, warns about the steps that changed nothing (with their real step numbers, no loss), and
  resumes; updates that would make the weights non-finite are rolled back and reported the same way;
* the fault chain: kill -9 of a trainer rank, SIGTERM with ``checkpoint.on_signal``, kill -9 of the driver
  between committing a checkpoint and writing its metrics line, SIGTERM, a damaged newest checkpoint — each
  resumed — and kill -9 of the rollout engine's server — recovered within the run — ends with metrics equal to
  an uninterrupted run's (timings and recovery counters excluded); the run's listening sockets are all on
  loopback; nothing of the run outlives its SIGKILL'd driver.
"""

import importlib.util
import os
import sys

import pytest

from megatron_rl.metrics import read_metrics

from run_helpers import REPO, TINY_RECIPE, check_ok, quick_assets, run_cli, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

_spec = importlib.util.spec_from_file_location("chaos", os.path.join(REPO, "tools", "chaos.py"))
chaos = importlib.util.module_from_spec(_spec)
sys.modules["chaos"] = chaos
_spec.loader.exec_module(chaos)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return quick_assets(tmp_path_factory.mktemp("assets"))


def test_bad_inputs_are_one_clear_line_each_and_lose_nothing(tmp_path, assets):
    results = chaos.bad_inputs(str(tmp_path), assets)
    assert len(results) == len(chaos.BAD_INPUTS) >= 50
    bad = [(r.name, r.exit_code, r.traceback, r.data_lost, r.message) for r in results
           if not r.clear or r.traceback or r.data_lost]
    assert not bad, "\n".join(map(str, bad))


def test_cold_start_without_signal_checkpoints_warns_and_resumes(tmp_path, assets):
    out = tmp_path / "cold"
    # random init, no warm-up: every group's rewards are equal, dynamic sampling keeps none, no optimizer step
    common = ["checkpoint.interval=1", "eval.interval=0", "logging.warn_no_update_steps=2"]
    proc = run_cli(["train", TINY_RECIPE, *tiny_overrides(assets, out, *common, steps=2, warmup=0)])
    check_ok(proc)
    assert (out / "checkpoints" / "iter_0000001").is_dir() and (out / "checkpoints" / "iter_0000002").is_dir()
    lines = read_metrics(str(out))
    assert [m["step"] for m in lines] == [1, 2]
    assert all(m["train/skipped_empty_batch"] == 1.0 and "train/loss" not in m for m in lines)
    assert "step 1 skipped: nothing to train on" in proc.stderr and "step 2 skipped" in proc.stderr
    assert "steps 1-2: 2 steps in a row changed no weight" in proc.stderr
    proc = run_cli(["train", TINY_RECIPE, *tiny_overrides(assets, out, *common, "resume=true", steps=3, warmup=0)])
    check_ok(proc)
    assert "resumed from" in proc.stderr and "at step 2" in proc.stderr
    assert [m["step"] for m in read_metrics(str(out))] == [1, 2, 3]


def test_diverging_update_is_rolled_back_and_reported(tmp_path, assets):
    """Finite gradients, a finite but absurd LR and weight decay: every update would make the weights inf. Each
    step is rolled back (the engines keep finite weights: the sync check passes), logged with its step and
    without a loss, and the run warns that nothing changed."""
    out = tmp_path / "diverge"
    extra = ["optim.lr=1e30", "optim.weight_decay=1e10", "eval.interval=0", "logging.warn_no_update_steps=2"]
    proc = run_cli(["train", TINY_RECIPE, *tiny_overrides(assets, out, *extra, steps=2, warmup=2)])
    check_ok(proc)
    lines = read_metrics(str(out))
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["train/skipped"] == 1.0 and m["train/nonfinite_weights"] == 1.0 and m["train/optimizer_step"] == 0.0
        assert "train/loss" not in m and m["sync/probe_max_abs_diff"] < 1e-4
    for step in (1, 2):
        assert f"step {step}: optimizer step skipped (the update made the weights non-finite; rolled back)" in proc.stderr
    assert "steps 1-2: 2 steps in a row changed no weight" in proc.stderr


def test_fault_chain_resumes_to_the_uninterrupted_metrics(tmp_path, assets):
    res = chaos.fault_chain(str(tmp_path), assets)
    assert res.sockets and not res.non_loopback, res.sockets
    assert not res.lingering_after_kill, res.lingering_after_kill
    failed = [(f.fault, f.exit_code, f.detail) for f in res.faults if not f.survived]
    assert not failed, failed
    assert res.metrics_equal, res.differences[:10]


def test_stopped_engine_and_trainer_rank_are_caught_within_their_bounds_and_resume_equal(tmp_path, assets):
    """Issue 28: the engine server SIGSTOPped while its memory is released (a hold) is detected within
    rollout.control_timeout_s and recovered in the run; a SIGSTOPped trainer rank is named within
    cluster.stall_warn_s, the run stops with one line after cluster.stall_fail_s, and resume=true ends with the
    uninterrupted run's metrics."""
    res = chaos.stall_faults(str(tmp_path), assets)
    bounds = chaos.STALL_BOUNDS
    assert res.engine_detect_s is not None and res.engine_detect_s <= bounds["control_timeout_s"], res
    assert res.rank_warn_s is not None and res.rank_warn_s <= bounds["stall_warn_s"] + 5, res
    assert bounds["stall_fail_s"] <= res.rank_fail_s, res
    failed = [(f.fault, f.exit_code, f.detail) for f in res.faults if not f.survived]
    assert not failed, failed
    assert res.metrics_equal, res.differences[:10]


# every server case but the dead port's (its 30 s connect deadline): ~5 s (the full list: python tools/chaos.py --inputs)
SERVER_SKIPPED = "/init_weights_update_group to a dead port"
SERVER_ACCEPTED = {"top_k 10**20 (int)", "top_k 2**63", "temperature 1e-45", "temperature 1e-300",  # as SGLang does
                   "stop_token_ids [10**30]", "top_logprobs_num 10**20", "logprob_start_len 10**20"}


def test_server_bad_inputs_are_counted_with_the_others(tmp_path, assets):
    """Issue 28: the rollout server's bad requests are a class of chaos.py's bad inputs, each against one embedded
    server next to a well-formed request that must still answer 200: a 4xx with a message (a valid 2xx where
    SGLang accepts the input too), no 5xx, no hang, the server neither paused nor writing outside its folder."""
    assert chaos.INPUT_CLASSES["rollout server"] is chaos.server_inputs
    names = [n for n, _ in chaos._chaos_server().server_cases(("w", (1,)), str(tmp_path)) if n != SERVER_SKIPPED]
    results = chaos.server_inputs(str(tmp_path / "server"), assets, names=names)
    assert sorted(r.name for r in results) == sorted(names) and len(names) >= 50
    counts = chaos.input_counts(results)
    assert counts == dict(tried=len(names), clear=len(names), tracebacks=0, hangs=0, data_lost=0), \
        [(r.name, r.exit_code, r.message) for r in results if not r.clear or r.traceback or r.hang or r.data_lost]
    accepted = {r.name for r in results if r.exit_code == 200}
    assert accepted == SERVER_ACCEPTED, accepted  # every other case is refused with a 4xx and a message
    assert all(400 <= r.exit_code < 500 and r.message for r in results if r.name not in SERVER_ACCEPTED)


def test_a_dry_run_that_blocks_is_counted_as_a_hang_not_waited_on(tmp_path, assets, monkeypatch):
    """A bad input whose --dry-run blocks (a FIFO nobody writes, as data.path once did) ends the case as a hang
    after chaos_inputs.DRY_RUN_S instead of blocking the campaign."""
    from megatron_rl import cli

    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    monkeypatch.setattr(sys.modules["chaos_inputs"], "DRY_RUN_S", 1)  # where check_input reads it
    monkeypatch.setattr(cli, "main", lambda argv: open(fifo).read())
    r = chaos.check_input(chaos.Case("blocks", [], "never"), str(tmp_path / "work"), assets)
    assert (r.hang, r.clear, r.traceback, r.data_lost) == (True, False, False, False), r
    assert chaos.input_counts([r])["hangs"] == 1
