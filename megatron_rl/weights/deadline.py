"""Deadlines for a weight sync: one budget for the whole transaction, every HTTP call and collective of it bounded
by what is left, and a watchdog that aborts a stuck process group instead of waiting on it.

``rollout.weights.sync.timeout_s`` (None: :func:`default_timeout_s`) is the budget; one HTTP call gets at most a quarter of it (``Deadline.call_bound``), so an engine that stops answering
is failed while the others still have time to finish. A blocking collective cannot be
interrupted from Python, so :class:`Watchdog` runs beside it: when the deadline passes first, it calls ``abort``
(destroying the weight group, or ``ProcessGroup.abort`` where the backend has it), which makes the blocked call
raise; the sync then fails as a transaction (``sync/aborted``) instead of hanging.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)

FLOOR_S = 120.0  # no sync deadline below this: process start-up noise, a cold first bucket, the probe forward
ASSUMED_GB_PER_S = 1.0  # a link not measured yet: slower than any real NIC or PCIe path, so the deadline is generous
SLACK = 10.0  # the deadline allows this many times the transfer time the link's rate predicts
CALL_SHARE = 0.25  # one HTTP call may take this share of the deadline: a stuck engine leaves the others time to finish


class SyncTimeout(TimeoutError):
    """A weight sync ran past its deadline (``rollout.weights.sync.timeout_s``)."""


class TrainerStalled(SyncTimeout):
    """A trainer rank did not send its weights by the deadline: the trainer's process group is unusable."""


def default_timeout_s(total_bytes: int, gb_per_s: Optional[float] = None) -> float:
    """``max(120 s, 10 x bytes / rate)``: ``gb_per_s`` is the link's measured rate (the last sync's), else 1 GB/s."""
    rate = gb_per_s if gb_per_s is not None and gb_per_s > 0 else ASSUMED_GB_PER_S
    return max(FLOOR_S, SLACK * total_bytes / (rate * 1e9))


class Deadline:
    """``seconds`` from now; ``bound(t)`` caps a call's own timeout ``t`` by what is left (at least ``min_s``)."""

    def __init__(self, seconds: float, what: str = "weight sync", min_s: float = 0.05):
        if not seconds > 0:
            raise ValueError(f"{what}: deadline {seconds!r} s, expected > 0")
        self.seconds, self.what, self.min_s = float(seconds), what, min_s
        self.start = time.monotonic()
        self.end = self.start + self.seconds

    def remaining(self) -> float:
        return self.end - time.monotonic()

    @property
    def expired(self) -> bool:
        return self.remaining() <= 0

    def bound(self, timeout_s: Optional[float] = None) -> float:
        left = max(self.remaining(), self.min_s)
        return left if timeout_s is None else min(float(timeout_s), left)

    def call_bound(self, timeout_s: Optional[float] = None) -> float:
        """One call's timeout: :meth:`bound`, and at most ``CALL_SHARE`` of the whole deadline (a bucket is at most
        the model, whose transfer the default deadline allows ``SLACK`` times over)."""
        return self.bound(min(self.seconds * CALL_SHARE, float("inf") if timeout_s is None else float(timeout_s)))

    def check(self, phase: str) -> None:
        if self.expired:
            raise SyncTimeout(f"{self.what}: the {phase} phase ran past the deadline of {self.seconds:.1f} s "
                              "(rollout.weights.sync.timeout_s)")


class Watchdog:
    """``with Watchdog(deadline, abort, what):`` -- if the block is still running when ``deadline`` passes,
    ``abort()`` is called from a daemon thread (once); ``fired`` says whether it was."""

    def __init__(self, deadline: Deadline, abort: Callable[[], None], what: str):
        self.deadline, self.abort, self.what = deadline, abort, what
        self.fired = False
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "Watchdog":
        self._thread = threading.Thread(target=self._run, name="weight-sync-watchdog", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        if self._done.wait(max(self.deadline.remaining(), 0.0)):
            return
        self.fired = True
        log.error("%s: still blocked at the deadline (%.1f s): aborting it", self.what, self.deadline.seconds)
        try:
            self.abort()
        except Exception as e:  # noqa: BLE001 - the blocked call raises whatever the abort leaves it
            log.warning("%s: abort failed: %s: %s", self.what, type(e).__name__, e)

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
