"""Run failures the user can act on, reported as such (the CLI prints them without a traceback, exit 1).

* :class:`RunError`: a failure with a complete message (a trainer rank died, a checkpoint cannot be
  written or read, the weights diverged).
* :func:`user_errors`: the exception types whose message is the whole story (a checkpoint without space or
  damaged, diverged weights, a rollout server that stopped answering, a failed weight-sync check).
* :func:`from_ray_error`: what a Ray call raised, turned into a ``RunError`` when it is one of those: a dead
  actor is named (rank, pid) with the last lines of its log; an error raised inside an actor keeps its own
  message without the remote traceback.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

from megatron_rl.rollout.client.http_client import ServerUnavailableError
from megatron_rl.training.checkpoint_integrity import (
    CheckpointCorruptError, CheckpointMismatchError, CheckpointSpaceError,
)
from megatron_rl.weights.sync import WeightSyncError

_RAY_LOG_MARKERS = (":job_id:", ":actor_name:", ":task_name:")


def user_errors() -> Tuple[type, ...]:
    return (RunError, CheckpointSpaceError, CheckpointCorruptError, CheckpointMismatchError, FloatingPointError,
            ServerUnavailableError, WeightSyncError)


class RunError(RuntimeError):
    """A run failed for a reason its message explains; the latest checkpoint is intact."""


def identity() -> Dict[str, Optional[str]]:
    """This process's pid and the file its stderr goes to (a Ray worker's ``worker-*.err`` log)."""
    try:
        log = os.readlink("/proc/self/fd/2")
    except OSError:
        log = None
    return {"pid": os.getpid(), "log": log if log and os.path.isfile(log) else None}


def log_tail(path: Optional[str], lines: int = 15) -> List[str]:
    if not path:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip() and not line.startswith(_RAY_LOG_MARKERS)][-lines:]


def actor_death(what: str, who: Dict[str, Optional[str]], method: str, error: BaseException) -> RunError:
    """``RunError`` naming a dead actor (``what``, e.g. "trainer rank 1"), its pid, why Ray says it died,
    and its last log lines."""
    text = str(error)
    detail = text.split("Worker exit detail:", 1)[1] if "Worker exit detail:" in text else ""
    detail = (detail.split(" Some common causes", 1)[0].strip().splitlines() or [""])[0][:200]
    log = who.get("log")
    lines = log_tail(log)
    tail = (f"\nits last log lines ({log}):\n    " + "\n    ".join(lines)) if lines else \
        (f"\nits log ({log}) is empty" if log else "")
    pid = f" (pid {who['pid']})" if who.get("pid") else ""
    return RunError(f"{what}{pid} died during {method}" + (f" ({detail})" if detail else "") + tail)


def from_ray_error(error: BaseException) -> Optional[RunError]:
    """The user-facing error inside a ``RayTaskError`` (its message, not the remote traceback), or None."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, user_errors()):
        return RunError(str(cause))
    return None
