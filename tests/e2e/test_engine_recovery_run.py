"""Engine recovery end to end: ``megatron-rl train`` on the tiny recipe with 2 engines whose servers are
SIGKILLed (``MEGATRON_RL_TEST_KILL_ENGINE``): engine 0 right before step 1's weight sync (the sync's transaction
fails it at stage and commits on engine 1; engine 0 is restarted and re-admitted after its own verified sync while
the run goes on), engine 1 in the middle of step 2's rollout (its requests go to
engine 0), both in the middle of step 3's (the requests wait for a restart, as with a single engine). The
run finishes; each killed engine is restarted, re-synced and re-admitted; no sample is lost -- seeded
rollouts make every metric equal an uninterrupted run's (up to the float rounding of batching)."""

import pytest

from megatron_rl.metrics import RECOVERY_COUNTERS, WALL_CLOCK, read_metrics

from run_helpers import TINY_RECIPE, check_ok, quick_assets, run_cli, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# wall clock (link rates, sync phase seconds included), and the recovery's and the sync transaction's own counters
_NOT_COMPARED = (*WALL_CLOCK, *RECOVERY_COUNTERS)


def test_engines_killed_mid_rollout_the_run_matches_the_uninterrupted_one(tmp_path):
    assets = quick_assets(tmp_path / "assets")
    common = ["checkpoint.save_hf=false", "eval.interval=0"]
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    check_ok(run_cli(["train", TINY_RECIPE, *tiny_overrides(assets, reference, *common, steps=3)], timeout=600))
    proc = run_cli(["train", TINY_RECIPE, *tiny_overrides(assets, killed, *common, "rollout.num_engines=2", steps=3)],
                   env={"MEGATRON_RL_TEST_KILL_ENGINE": "1:0:sync,2:1,3:0,3:1"}, timeout=600)
    check_ok(proc)
    log = proc.stderr
    for engine in (0, 1):
        assert f"fault injection: SIGKILL to engine {engine}'s server" in log
        assert f"engine {engine} back in rotation after" in log
    assert "fault injection: SIGKILL to engine 0's server before weight sync v1" in log
    assert "weight sync v1: engine 0 (" in log and "failed at stage" in log  # the transaction, not a retry
    assert "the run goes on with engines [1]" in log and "syncing again" not in log
    # the sync's kill is seen by the transaction or by the exit poll first, whichever is earlier
    assert log.count("exited with code -9 (SIGKILL); out of rotation") >= 3
    back = [line for line in log.splitlines() if "back in rotation after" in line]
    assert len(back) == 4 and all("probe max |dlogp|" in line for line in back)  # each passed the probe check

    lines, ref = read_metrics(str(killed)), read_metrics(str(reference))
    assert [m["step"] for m in lines] == [m["step"] for m in ref] == [1, 2, 3]
    assert lines[-1]["engine/restarts"] == 4.0 and lines[0]["engine/restarts"] <= 1.0
    assert lines[0]["sync/engines_committed"] == 1.0 and lines[0]["sync/engines_failed"] == 1.0
    assert lines[1]["sync/engines_committed"] == 2.0 and lines[1]["sync/engines_failed"] == 0.0
    assert lines[0]["engine/resent_requests"] == 0 < lines[1]["engine/resent_requests"] < lines[2]["engine/resent_requests"]
    assert lines[2]["engine/out_seconds"] > lines[1]["engine/out_seconds"] > 0
    assert "train/loss" in lines[1]  # step 2 trained on the samples of the recovered rollout
    for got, want in zip(lines, ref):
        keys = {k for k in want if not k.startswith(_NOT_COMPARED)}
        assert keys == {k for k in got if not k.startswith(_NOT_COMPARED)}, got["step"]
        for k in keys:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), (got["step"], k, want[k], got[k])
