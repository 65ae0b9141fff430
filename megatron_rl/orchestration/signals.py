"""SIGTERM and SIGINT for a run: SLURM preemption, ``timeout`` and ``kill`` stop it the way Ctrl-C does.

Without ``checkpoint.on_signal`` the first signal raises :class:`Interrupted` (a ``KeyboardInterrupt``)
wherever the driver is: the run closes its workers and Ray and exits with ``128 + signal``; the latest
checkpoint is where ``resume=true`` continues. With it, the first signal is only noted: the driver finishes
the step, checkpoints it and then stops (a second signal stops at once). Ray's own SIGTERM handler (a bare
``sys.exit(15)``, installed by ``ray.init``: a SIGTERM would end the run with no message and no checkpoint)
never stays in place: ``ray.init`` runs inside :func:`keep_handlers`.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from typing import Dict, Iterator, Optional

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal (``signum``); ``checkpoint_step`` is set when it checkpointed first."""

    def __init__(self, signum: int, checkpoint_step: Optional[int] = None):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.checkpoint_step = signum, checkpoint_step


class StopSignals:
    """``with StopSignals(graceful) as stop:`` ... ``stop.requested`` (the signal number, once one came)."""

    def __init__(self, graceful: bool):
        self.graceful = graceful
        self.requested: Optional[int] = None
        self._previous: Dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals are delivered to the main thread only; nothing to do elsewhere
        for sig in SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    def _handle(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        if self.graceful and self.requested is None:
            self.requested = signum
            logger.warning("%s: finishing this step, then a checkpoint and a clean stop (send it again to stop now)",
                           name)
            return
        logger.warning("%s: stopping now (the latest checkpoint is where resume=true continues)", name)
        raise Interrupted(signum)


@contextlib.contextmanager
def keep_handlers() -> Iterator[None]:
    """Around ``ray.init``: restores the SIGTERM handler it replaces with ``sys.exit(15)``; a SIGTERM that
    lands inside it (Ray half started) becomes :class:`Interrupted`, stopping the run like any other."""
    saved = signal.getsignal(signal.SIGTERM)
    try:
        yield
    except SystemExit as e:
        if e.code != signal.SIGTERM:
            raise
        raise Interrupted(signal.SIGTERM) from None
    finally:
        if threading.current_thread() is threading.main_thread() and saved is not None:
            signal.signal(signal.SIGTERM, saved)
