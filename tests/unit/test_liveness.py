"""Liveness (issue 28): control calls to an engine are bounded by ``rollout.control_timeout_s``; a SIGSTOPped engine
server is seen from ``/proc`` even while the driver holds the engines, killed at once (a call waiting on it fails
now) and recovered when the hold ends; a silent trainer rank is named in a warning, then fails the run; the new
config fields are validated."""

import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from megatron_rl.config import RecoveryConfig  # noqa: F401 - the section the monitor reads
from megatron_rl.config.rollout import ClientConfig, normalize_keys
from megatron_rl.config.run import ClusterConfig
from megatron_rl.orchestration.heartbeat import StallWatch, TrainerStallError, current_phase
from megatron_rl.rollout.client.http_client import SGLangClient, ServerUnavailableError
from megatron_rl.rollout.client.proc_state import stopped_in_group

from test_engine_recovery import _wait_for, _watched, model_dir, trained  # noqa: F401 - fixtures


def _call_with_deadline(fn, deadline_s: float):
    """(seconds taken, exception or None); fails the test if ``fn`` is still running after ``deadline_s``."""
    out = {}

    def run():
        start = time.monotonic()
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            out["error"] = e
        out["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(deadline_s)
    assert not thread.is_alive(), f"the call was still waiting after {deadline_s} s"
    return out["seconds"], out.get("error")


def test_control_calls_are_bounded_by_control_timeout_not_request_timeout():
    """A server that accepts connections and never answers (a stopped process: the kernel still completes the
    handshake): every control call gives up after control_timeout_s with ServerUnavailableError, once."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    try:
        client = SGLangClient(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout_s=600.0, control_timeout_s=1.0)
        calls = {"pause_generation": lambda c: c.pause_generation("in_place"), "continue_generation": None,
                 "flush_cache": None, "release_memory_occupation": None, "resume_memory_occupation": None,
                 "update_weight_version": lambda c: c.update_weight_version("v2")}
        for name, call in calls.items():
            seconds, error = _call_with_deadline(lambda: (call or getattr(type(client), name))(client), 20)
            assert isinstance(error, ServerUnavailableError), (name, error)
            assert "no answer within 1 s" in str(error) and "1 attempt(s)" in str(error), (name, error)
            assert 0.9 <= seconds < 5.0, (name, seconds)
        # a call's own timeout wins; a restarted engine's client keeps the bound
        seconds, error = _call_with_deadline(lambda: client.flush_cache(timeout_s=0.3), 20)
        assert isinstance(error, ServerUnavailableError) and 0.25 <= seconds < 3.0
        assert client.with_url("http://127.0.0.1:1").control_timeout_s == 1.0
    finally:
        silent.close()


def test_control_timeout_and_stall_bounds_are_validated():
    assert ClientConfig().control_timeout_s == 30.0
    for bad in (0, -1.0, math.nan, math.inf, True, "30"):
        with pytest.raises(ValueError, match=r"rollout.control_timeout_s=.*expected a finite number of seconds > 0"):
            ClientConfig(control_timeout_s=bad)
    assert normalize_keys({"control_timeout_s": 5}) == {"client": {"control_timeout_s": 5}}
    c = ClusterConfig()
    assert (c.stall_warn_s, c.stall_fail_s) == (60.0, 600.0)
    for field, bad in (("stall_warn_s", 0), ("stall_fail_s", math.nan), ("stall_warn_s", -5), ("stall_fail_s", False)):
        with pytest.raises(ValueError, match=f"cluster.{field}="):
            ClusterConfig(**{field: bad})
    with pytest.raises(ValueError, match=r"cluster.stall_fail_s=10 < cluster.stall_warn_s=20"):
        ClusterConfig(stall_warn_s=20, stall_fail_s=10)


def test_stopped_processes_are_read_from_proc():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        assert stopped_in_group(proc.pid) == []
        os.kill(proc.pid, signal.SIGSTOP)
        _wait_for(lambda: stopped_in_group(proc.pid) == [proc.pid], 10, "the stopped state")
        os.kill(proc.pid, signal.SIGCONT)
        _wait_for(lambda: stopped_in_group(proc.pid) == [], 10, "the running state")
    finally:
        proc.kill()
        proc.wait()


def test_a_stopped_server_during_a_hold_is_killed_at_once_and_recovered_after(model_dir, tmp_path,  # noqa: F811
                                                                             trained):  # noqa: F811
    """The driver holds the only engine (a weight sync, say) and its server is SIGSTOPped: on main nothing looked at
    it until the hold ended and a control call waited its whole timeout. Now the monitor reads the stopped state,
    kills the server within poll_s + 1 s, so the waiting call fails at once; the restart waits for the hold's end."""
    with _watched(model_dir, tmp_path, trained, servers=1, max_restarts=1) as (workers, engine, monitor, trainer):
        hold = monitor.hold("weight sync")
        stopped_at = time.monotonic()
        os.kill(workers[0].process.proc.pid, signal.SIGSTOP)
        seconds, error = _call_with_deadline(lambda: engine.update_weight_version("v2"), 25)
        detected = time.monotonic() - stopped_at
        assert isinstance(error, ServerUnavailableError), error
        assert detected < 10.0, detected  # poll_s 0.2 + 1 s grace (+ load); the client's own bound is 30 s
        assert "exited with code -9 (SIGKILL)" in workers[0].exit_status()
        _wait_for(lambda: not engine.available[0], 10, "out of rotation")
        time.sleep(0.5)
        assert monitor.restarts == 0 and trainer.synced == []  # nothing restarts during the hold
        hold.release()
        _wait_for(lambda: monitor.restarts == 1 and all(engine.available), 120, "the restart after the hold")
        assert trainer.synced == [(0, engine.clients[0].url)] and workers[0].exit_status() is None
        engine.update_weight_version("v1")
        assert engine.clients[0].get_weight_version() == "v1"


def test_stall_watch_names_a_silent_rank_then_fails(caplog):
    watch = StallWatch(board=None, warn_s=5.0, fail_s=12.0)  # scan() is fed what the board would answer
    caplog.set_level(logging.WARNING, logger="megatron_rl.orchestration.heartbeat")
    watch.scan({0: (0.5, 100, "10.0.0.1", "train_step"), 1: (4.0, 101, "10.0.0.2", "train_step")})
    assert not caplog.records
    watch.scan({0: (0.5, 100, "10.0.0.1", "train_step"), 1: (6.0, 101, "10.0.0.2", "train_step")})
    watch.scan({0: (0.5, 100, "10.0.0.1", "train_step"), 1: (7.0, 101, "10.0.0.2", "train_step")})
    (warning,) = [r.getMessage() for r in caplog.records]  # once per silence
    assert "trainer rank 1 (node 10.0.0.2, pid 101) has been silent for 6 s (last phase: train_step)" in warning
    assert "cluster.stall_fail_s=12" in warning
    watch.check()  # not yet
    watch.scan({0: (0.5, 100, "10.0.0.1", "idle"), 1: (12.5, 101, "10.0.0.2", "train_step")})
    with pytest.raises(TrainerStallError, match=r"trainer rank 1 \(node 10.0.0.2, pid 101\) has been silent for "
                                                r"12 s \(last phase: train_step\) >= cluster.stall_fail_s=12"):
        watch.check()
    # a rank that beats again after a warning is logged as back
    other = StallWatch(board=None, warn_s=5.0, fail_s=12.0)
    other.scan({0: (6.0, 100, "n", "forward")})
    other.scan({0: (0.1, 100, "n", "forward")})
    assert caplog.records[-1].getMessage() == "trainer rank 0 (node n, pid 100) beats again"


def test_current_phase_is_the_outermost_trainer_worker_method():
    """What a rank reports as its phase: the outermost frame of a TrainerWorker method on any thread."""
    ns = {}
    exec(compile("def train_step(ev, inner):\n    return inner(ev)\ndef _inner(ev):\n    ev.wait(10)\n",
                 "/somewhere/megatron_rl/orchestration/trainer_worker.py", "exec"), ns)
    assert current_phase() == "idle"
    ev = threading.Event()
    thread = threading.Thread(target=ns["train_step"], args=(ev, ns["_inner"]))
    thread.start()
    try:
        _wait_for(lambda: current_phase() == "train_step", 10, "the phase")
    finally:
        ev.set()
        thread.join()
