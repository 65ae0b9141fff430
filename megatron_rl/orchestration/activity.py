"""Busy time of the rollout engines, seen from the driver, for the idle-fraction metrics.

The engines work while at least one generation request of the driver is in flight and they are not paused
(a partial-rollout publish holds requests without computing). ``perf/engine_idle_frac`` of a step is one minus
the busy time over the step's wall time (:func:`megatron_rl.perf.step_metrics`): a driver-side estimate, HTTP
and queueing time count as busy.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

class BusyMeter:
    """Wall time during which at least one tracked activity runs and the meter is not suspended."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._suspended = 0
        self._since = None  # when the current busy interval started
        self._busy = 0.0
        self._mark = 0.0  # busy total at the last ``step_fraction``

    def _update(self, delta_active: int = 0, delta_suspended: int = 0) -> None:
        now = time.perf_counter()
        if self._since is not None:
            self._busy += now - self._since
        self._active += delta_active
        self._suspended += delta_suspended
        self._since = now if self._active > 0 and self._suspended == 0 else None

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        with self._lock:
            self._update(delta_active=1)
        try:
            yield
        finally:
            with self._lock:
                self._update(delta_active=-1)

    def suspend(self) -> None:
        """Not busy until :meth:`resume`, whatever is in flight (the engines are paused)."""
        with self._lock:
            self._update(delta_suspended=1)

    def resume(self) -> None:
        with self._lock:
            self._update(delta_suspended=-1)

    def total(self) -> float:
        with self._lock:
            self._update()
            return self._busy

    def since_last(self) -> float:
        """Busy seconds since the previous call."""
        total = self.total()
        out, self._mark = total - self._mark, total
        return out
