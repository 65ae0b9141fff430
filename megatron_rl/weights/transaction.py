"""A weight sync as one transaction over the engines of a run: stage -> verify -> commit.

* **stage**: every admitted engine opens its update session and receives every bucket (each with its checksum,
  :mod:`megatron_rl.weights.checksum`); an engine that refuses, breaks or does not answer within the deadline is
  failed at ``stage`` and gets no more buckets; the others go on.
* **verify**: the probe check per staged engine (``WeightSync.check``'s comparison, routing replayed for MoE); a
  mismatch or an engine that cannot score the probe is failed at ``verify``.
* **commit**: ``/update_weight_version`` on the verified engines only; the version of a failed engine never flips,
  so nothing it generates is labelled with weights it may hold only in part.

An engine that failed any step is reported (``failed``) for the engine monitor to take out of rotation, restart
and re-admit after its own verified sync; the run goes on with the rest. When no engine commits,
:meth:`SyncTransaction.raise_if_none_committed` raises one :class:`TransactionError` naming every engine, its
phase and its cause.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from megatron_rl.weights.deadline import Deadline
from megatron_rl.weights.probe import WeightSyncError

PHASES = ("stage", "verify", "commit")


class TransactionError(WeightSyncError):
    """No engine committed the new weights (every engine, its phase and cause in the message)."""


@dataclass
class EngineFailure:
    index: int
    url: str
    phase: str
    cause: str

    def describe(self) -> str:
        return f"engine {self.index} ({self.url}) failed at {self.phase}: {self.cause}"


@dataclass
class TransactionReport:
    """What the transaction did (picklable: it travels from trainer rank 0 to the driver in ``SyncStats``)."""

    version: str
    engines: int
    committed: List[int] = field(default_factory=list)
    failures: List[EngineFailure] = field(default_factory=list)
    phase_seconds: Dict[str, float] = field(default_factory=dict)
    aborted: bool = False  # the watchdog aborted a stuck collective (the deadline passed)

    def metrics(self) -> Dict[str, float]:
        out = {f"sync/phase_seconds/{p}": float(self.phase_seconds.get(p, 0.0)) for p in PHASES}
        out.update({"sync/engines_committed": float(len(self.committed)),
                    "sync/engines_failed": float(len(self.failures)), "sync/aborted": float(self.aborted)})
        return out


class SyncTransaction:
    """The per-engine state of one sync (module doc); ``urls[i]`` names engine ``i``."""

    def __init__(self, version: str, urls: Sequence[str], deadline: Deadline):
        self.version, self.urls, self.deadline = str(version), list(urls), deadline
        self.report = TransactionReport(version=self.version, engines=len(self.urls))
        self._failed: Dict[int, EngineFailure] = {}

    def alive(self) -> List[int]:
        """Engines that have not failed (in order)."""
        return [i for i in range(len(self.urls)) if i not in self._failed]

    def fail(self, index: int, phase: str, cause: BaseException | str) -> None:
        """Engine ``index`` failed at ``phase`` (its first failure is the one reported)."""
        if phase not in PHASES:
            raise ValueError(f"phase={phase!r}: expected one of {PHASES}")
        if index in self._failed:
            return
        text = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        failure = EngineFailure(index, self.urls[index], phase, (text.strip().splitlines() or [""])[-1][:500])
        self._failed[index] = failure
        self.report.failures.append(failure)

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.report.phase_seconds[name] = self.report.phase_seconds.get(name, 0.0) + time.perf_counter() - start

    def committed(self, indices: Sequence[int]) -> None:
        self.report.committed = sorted(indices)

    def raise_if_none_alive(self, phase: str) -> None:
        if not self.alive():
            raise self._error(phase)

    def _error(self, phase: str) -> TransactionError:
        causes = "; ".join(f.describe() for f in self.report.failures) or "no engine was admitted"
        return TransactionError(f"weight sync v{self.version}: no engine committed the new weights (every one failed "
                                f"by the {phase} phase): {causes}. The step fails rather than going on with old "
                                "weights.")


def failures_text(failures: Sequence[EngineFailure]) -> Optional[str]:
    return "; ".join(f.describe() for f in failures) if failures else None
