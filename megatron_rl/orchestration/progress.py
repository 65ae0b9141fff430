"""Progress bars for work that runs inside Ray actors: training micro-batches, forward passes, weight sync.

A tqdm bar drawn inside an actor does not render: Ray forwards the actor's stderr line by line and a bar
redraws with ``\\r``. So one trainer rank reports ``(bar, done, total, unit)`` to a small board actor and
the driver draws the bars while it waits for the call (:meth:`ProgressBoard.wait`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import ray

from megatron_rl.metrics import progress

State = Tuple[int, int, str]  # done, total, unit


class _Board:
    """The actor: the latest state of each bar (reports overwrite; nothing queues up)."""

    def __init__(self) -> None:
        self.bars: Dict[str, State] = {}

    def report(self, desc: str, done: int, total: int, unit: str) -> None:
        self.bars[desc] = (done, total, unit)

    def take(self) -> Dict[str, State]:
        bars, self.bars = self.bars, {}
        return bars


class Reporter:
    """The actor side, picklable: ``reporter(desc, done, total, unit)``. Fire-and-forget, at most a few
    calls a second per bar, so reporting never slows the step."""

    def __init__(self, board: Any, min_interval_s: float = 0.2):
        self.board, self.min_interval_s = board, min_interval_s
        self._last: Dict[str, float] = {}

    def __call__(self, desc: str, done: int, total: int, unit: str = "it") -> None:
        now = time.monotonic()
        if done < total and now - self._last.get(desc, 0.0) < self.min_interval_s:
            return
        self._last[desc] = now
        self.board.report.remote(desc, done, total, unit)


class ProgressBoard:
    """The driver side: creates the board actor, hands out :class:`Reporter` s, draws the bars."""

    def __init__(self, poll_s: float = 0.25):
        # num_cpus=0: an actor asks for one CPU to be scheduled unless told otherwise; the run's CPUs
        # are all reserved by placement groups
        self.actor = ray.remote(_Board).options(num_cpus=0).remote()
        self.poll_s = poll_s

    def close(self) -> None:
        ray.kill(self.actor)

    def reporter(self) -> Reporter:
        return Reporter(self.actor)

    def wait(self, refs: List[Any], on_poll: Optional[Callable[[], None]] = None) -> List[Any]:
        """``ray.get(refs)``, drawing the reported bars meanwhile (each closes when its call returns); ``on_poll``
        (the trainer heartbeat's check, which raises to stop waiting) is called between polls."""
        bars: Dict[str, Any] = {}
        try:
            pending = list(refs)
            while pending:
                _, pending = ray.wait(pending, num_returns=len(pending), timeout=self.poll_s)
                if on_poll is not None:
                    on_poll()
                self._draw(bars, ray.get(self.actor.take.remote(), timeout=60))
            return ray.get(refs)
        finally:
            for bar in bars.values():
                bar.close()

    @staticmethod
    def _draw(bars: Dict[str, Any], states: Dict[str, State]) -> None:
        for desc, (done, total, unit) in states.items():
            bar = bars.get(desc)
            if bar is None and done >= total:
                continue  # finished before it was ever drawn (or a late report of a previous call)
            if bar is None or bar.total != total:
                if bar is not None:
                    bar.close()
                bar = bars[desc] = progress(total, desc, True, unit=unit, scale=unit == "B")
            bar.update(done - bar.n)


def maybe_board(enabled: bool) -> Optional[ProgressBoard]:
    return ProgressBoard() if enabled else None
