"""Fault injection for the reliability tests, installed into :mod:`megatron_rl.orchestration.hooks`.

``python tests/fault_hooks.py ARGS`` is ``megatron-rl ARGS`` with the faults the environment names:

* ``MEGATRON_RL_TEST_KILL_ENGINE=STEP:ENGINE[:PHASE][,...]``: SIGKILL engine ENGINE's server during step
  STEP's ``rollout`` (the default; once a request is in flight on it) or right before its weight ``sync``
  (the run needs ``rollout.recovery``: the kills go through the engine monitor's handles).
* ``MEGATRON_RL_FAULT=after_checkpoint:STEP``: SIGKILL the driver right after step STEP's checkpoint.
* ``MEGATRON_RL_TEST_STOP_ENGINE=N``: SIGSTOP the embedded engine server right after the driver released the
  colocated engines' memory for the N-th time in this process (a hold: no ``/health``, no restarts until it ends).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Dict, List, Mapping, Optional, Tuple

from megatron_rl.cli import main
from megatron_rl.orchestration import hooks

KILL_ENV = "MEGATRON_RL_TEST_KILL_ENGINE"
FAULT_ENV = "MEGATRON_RL_FAULT"
STOP_ENV = "MEGATRON_RL_TEST_STOP_ENGINE"
ENV_NAMES = (KILL_ENV, FAULT_ENV, STOP_ENV)
SCRIPT = os.path.abspath(__file__)
log = logging.getLogger("megatron_rl.fault_injection")


def kill_plan(value: Optional[str]) -> Dict[Tuple[int, str], List[int]]:
    """The ``MEGATRON_RL_TEST_KILL_ENGINE`` variable, ``STEP:ENGINE[:PHASE][,...]``, -> {(step, phase): [engines]}."""
    plan: Dict[Tuple[int, str], List[int]] = {}
    for item in filter(None, (value or "").replace(" ", "").split(",")):
        parts = item.split(":")
        try:
            step, engine = int(parts[0]), int(parts[1])
            phase = parts[2] if len(parts) == 3 else "rollout" if len(parts) == 2 else ""
        except (ValueError, IndexError):
            phase = ""
        if phase not in ("rollout", "sync"):
            raise ValueError(f"{KILL_ENV}={value!r}: expected STEP:ENGINE[:rollout|sync][,...], e.g. 2:0 or 1:0:sync")
        plan.setdefault((step, phase), []).append(engine)
    return plan


def kill_when_busy(engine, index: int, handle, timeout_s: float = 300.0) -> threading.Thread:
    """SIGKILL server ``index`` (``handle.kill()``) as soon as a request is in flight on it: a crash mid-rollout."""
    def run() -> None:
        deadline = time.monotonic() + timeout_s
        while engine.outstanding[index] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        log.warning("fault injection: SIGKILL to engine %d's server (%d requests in flight on it)", index,
                    engine.outstanding[index])
        handle.kill()

    thread = threading.Thread(target=run, name=f"kill-engine-{index}", daemon=True)
    thread.start()
    return thread


def engine_server_pids() -> List[int]:
    """The run's embedded engine servers (found by the run token every process of the run carries)."""
    from megatron_rl.orchestration.ray_guard import ENV, run_pids

    out = []
    for pid in run_pids(os.environ[ENV], []):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"megatron_rl.rollout.embedded.server" in f.read():
                    out.append(pid)
        except OSError:
            pass
    return sorted(out)


def install_stop_engine(value: Optional[str]) -> None:
    """``MEGATRON_RL_TEST_STOP_ENGINE`` (module doc)."""
    if not value:
        return
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{STOP_ENV}={value!r}: expected N >= 1 (the N-th memory release)")
    releases = [0]

    def on_released(monitor) -> None:
        releases[0] += 1
        if releases[0] == int(value):
            for pid in engine_server_pids():
                log.warning("fault injection: SIGSTOP to the engine server (pid %d) while its memory is released", pid)
                os.kill(pid, signal.SIGSTOP)

    hooks.register("engines_released", on_released)


def install(env: Mapping[str, str] = os.environ) -> None:
    """Register the faults ``env`` names (none: nothing)."""
    plan = kill_plan(env.get(KILL_ENV))
    driver_fault = env.get(FAULT_ENV)

    def on_rollout(step: int, engine, monitor) -> None:
        for i in plan.get((step, "rollout"), []):
            kill_when_busy(engine, i, monitor.handles[i])

    def before_sync(version: int, monitor) -> None:
        for i in plan.pop((version, "sync"), []):
            log.warning("fault injection: SIGKILL to engine %d's server before weight sync v%s", i, version)
            monitor.handles[i].kill()

    def after_checkpoint(step: int) -> None:
        if driver_fault == f"after_checkpoint:{step}":
            os.kill(os.getpid(), signal.SIGKILL)

    if plan:
        hooks.register("rollout", on_rollout)
        hooks.register("before_sync", before_sync)
    if driver_fault:
        hooks.register("after_checkpoint", after_checkpoint)
    install_stop_engine(env.get(STOP_ENV))


if __name__ == "__main__":
    install()
    sys.exit(main())
