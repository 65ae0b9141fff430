"""Trainer heartbeats: a rank that goes silent is named, then the run stops with one clear error.

A trainer rank stopped by SIGSTOP, swapped out or hung with the GIL held answers nothing, and the other ranks
wait for it inside a collective: the driver's call never returns and nothing says why. So every rank runs a
:class:`Beater` thread that tells a small board actor (``num_cpus=0``) every ``interval_s`` that it is alive and
what it is doing (its phase: the outermost ``TrainerWorker`` method on its stack, or ``idle``). The board keeps
the time of each rank's last beat on its own clock (no clock skew between nodes).

The driver's :class:`StallWatch` reads the board every ``poll_s`` from a thread of its own, whatever phase the
driver is in:

* a rank silent for ``cluster.stall_warn_s`` is named in a warning (rank, node, pid, last phase), once per silence;
  a rank that beats again is logged as back;
* a rank silent for ``cluster.stall_fail_s`` fails the run: :meth:`StallWatch.check`, called between the
  driver's waits for trainer calls (``TrainerGroup``), raises :class:`TrainerStallError` naming the rank (the CLI
  adds the last committed checkpoint, where ``resume=true`` continues; the run's tear-down kills the ranks).
  While the driver waits for something else (a rollout), the error comes at its next trainer call.

The board itself not answering (Ray overloaded) judges nobody: the watch tries again at its next poll.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from typing import Any, Dict, Optional, Tuple

import ray

from megatron_rl.orchestration.failures import RunError

log = logging.getLogger(__name__)
_WORKER_FILES = ("trainer_worker.py", "trainer_weights.py")  # the TrainerWorker methods the driver calls


class TrainerStallError(RunError):
    """A trainer rank was silent for ``cluster.stall_fail_s``; the message names it and where to resume."""


class _Board:
    """The actor: each rank's last beat (board clock), pid, node and phase."""

    def __init__(self) -> None:
        self.beats: Dict[int, Tuple[float, int, str, str]] = {}

    def beat(self, rank: int, pid: int, node: str, phase: str) -> None:
        self.beats[rank] = (time.monotonic(), pid, node, phase)

    def silences(self) -> Dict[int, Tuple[float, int, str, str]]:
        """rank -> (seconds since its last beat, pid, node, last phase)."""
        now = time.monotonic()
        return {r: (now - t, pid, node, phase) for r, (t, pid, node, phase) in self.beats.items()}


def new_board() -> Any:
    return ray.remote(_Board).options(num_cpus=0).remote()


def current_phase(skip: Optional[int] = None) -> str:
    """The outermost TrainerWorker method running in this process (any thread but ``skip``), or ``idle``."""
    for ident, frame in sys._current_frames().items():
        if ident == skip:
            continue
        outer = None
        while frame is not None:
            if frame.f_code.co_filename.endswith(_WORKER_FILES):
                outer = frame.f_code.co_name
            frame = frame.f_back
        if outer is not None:
            return outer
    return "idle"


class Beater:
    """The rank's side: a daemon thread beating every ``interval_s`` (fire-and-forget actor calls)."""

    def __init__(self, board: Any, rank: int, interval_s: float):
        self.board, self.rank, self.interval_s = board, rank, interval_s
        self._stop = threading.Event()
        self._node = ray.util.get_node_ip_address() if ray.is_initialized() else socket.gethostname()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{rank}", daemon=True)

    def start(self) -> "Beater":
        self._thread.start()
        return self

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.is_set():
            try:
                self.board.beat.remote(self.rank, os.getpid(), self._node, current_phase(skip=me))
            except Exception:  # noqa: BLE001 - the board is gone (the run is closing): beating is best effort
                return
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()


def beat_interval(warn_s: float) -> float:
    """Beats often enough that a rank is never judged silent between two of them."""
    return max(0.05, min(5.0, warn_s / 5))


class StallWatch:
    """The driver's side (module doc)."""

    def __init__(self, board: Any, warn_s: float, fail_s: float, poll_s: Optional[float] = None):
        self.board, self.warn_s, self.fail_s = board, warn_s, fail_s
        self.poll_s = poll_s if poll_s is not None else beat_interval(warn_s)
        self._lock = threading.Lock()
        self._warned: Dict[int, float] = {}  # rank -> silence when warned
        self.error: Optional[TrainerStallError] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainer-stall-watch", daemon=True)

    def start(self) -> "StallWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=5)

    def check(self) -> None:
        """Raise the stall error if a rank has been silent for ``stall_fail_s``."""
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                silences = ray.get(self.board.silences.remote(), timeout=max(self.poll_s, 5.0))
            except Exception as e:  # noqa: BLE001 - an unanswered read judges nobody
                log.debug("trainer heartbeats: the board did not answer (%s)", e)
                continue
            self.scan(silences)
            if self.error is not None:
                return

    def scan(self, silences: Dict[int, Tuple[float, int, str, str]]) -> None:
        """Warn about, and fail on, the silences read from the board (rank -> (seconds, pid, node, phase))."""
        with self._lock:
            for rank, (silent, pid, node, phase) in sorted(silences.items()):
                who = f"trainer rank {rank} (node {node}, pid {pid})"
                if silent >= self.fail_s and self.error is None:
                    self.error = TrainerStallError(
                        f"{who} has been silent for {silent:.0f} s (last phase: {phase}) >= cluster.stall_fail_s="
                        f"{self.fail_s:g}: it is stopped (SIGSTOP?), hung or its node is overloaded; the run stops")
                    log.error("%s", self.error)
                elif silent >= self.warn_s and rank not in self._warned:
                    self._warned[rank] = silent
                    log.warning("%s has been silent for %.0f s (last phase: %s): stopped, hung or starved of CPU? "
                                "The run stops if it stays silent for cluster.stall_fail_s=%g s", who, silent, phase,
                                self.fail_s)
                elif silent < self.warn_s and rank in self._warned:
                    del self._warned[rank]
                    log.warning("%s beats again", who)
