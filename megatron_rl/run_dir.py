"""One run per output folder, and no run overwrites another's outputs.

* :class:`RunLock`: ``<logging.output_dir>/.megatron_rl.lock`` holds the owner's pid, host and process start
  time, created atomically (``O_EXCL``) by the driver before it writes anything and removed when it closes.
  A second run on the folder is refused with one line naming the owner. A lock whose owner is gone (same
  host, and that pid is dead or is now another process) is stale: taken over with a warning. A lock of another
  host cannot be checked from here: refused, and the message says how to remove it.
* :func:`output_problems`: a new run (``resume=false``) over a folder holding another run's ``metrics.jsonl``
  or checkpoints, or ``resume=true`` where nothing can be resumed but those files exist, is refused (it would
  truncate them); ``overwrite=true`` (``megatron-rl train --force``) starts over deliberately.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any, Callable, Dict, List, Optional

from megatron_rl.config_io import ConfigError
from megatron_rl.pids import pid_alive

logger = logging.getLogger(__name__)
LOCK_NAME = ".megatron_rl.lock"


class RunDirBusy(ConfigError):
    """The output folder belongs to a run that is still alive (or cannot be checked)."""


def _start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat): a pid reused by another
    process has another one. None where it cannot be read (not Linux, or no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner_alive(owner: Dict[str, Any]) -> Optional[bool]:
    """True / False for a lock of this host; None: another host's (cannot be checked from here)."""
    if not isinstance(owner.get("pid"), int):
        return False  # torn while being written (a crash): nobody to protect
    if owner.get("host") != socket.gethostname():
        return None
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0 or not pid_alive(pid):
        return False
    started = owner.get("started")
    return started is None or _start_time(pid) in (None, started)


def _read(path: str) -> Dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # torn by a crash while being written: no owner to protect


def describe_owner(owner: Dict[str, Any]) -> str:
    since = owner.get("time")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else ""
    return f"pid {owner.get('pid')} on host {owner.get('host')!r}{when}"


def busy_problem(output_dir: str) -> Optional[str]:
    """Why another run holds ``output_dir`` (its lock's owner is alive or on another host), or None."""
    path = os.path.join(output_dir, LOCK_NAME)
    if not os.path.exists(path):
        return None
    owner = _read(path)
    if owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
        return None  # this run's own
    alive = _owner_alive(owner)
    if alive is False:
        return None
    if alive is None:
        return (f"logging.output_dir={output_dir!r} is locked by a run of {describe_owner(owner)} ({path}); one run "
                "per output folder: wait for it or choose another output_dir (if that run is gone, delete the lock "
                "file)")
    return (f"logging.output_dir={output_dir!r} is in use by another run ({describe_owner(owner)}); one run per "
            "output folder: wait for it to finish, stop it, or choose another output_dir")


class RunLock:
    """The output folder's lock (see the module docstring); :meth:`acquire` raises :class:`RunDirBusy`."""

    def __init__(self, output_dir: str) -> None:
        self.path = os.path.join(output_dir, LOCK_NAME)
        self.owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": _start_time(os.getpid()),
                      "time": time.time()}
        self.held = False

    def acquire(self) -> "RunLock":
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        for _ in range(2):  # the second try after removing a stale lock
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                problem = busy_problem(os.path.dirname(self.path))
                if problem:
                    raise RunDirBusy(problem) from None
                logger.warning("removing the stale lock %s of a run that is gone (%s)", self.path,
                               describe_owner(_read(self.path)))
                try:
                    os.remove(self.path)
                except FileNotFoundError:
                    pass  # another starting run removed it: the O_EXCL create decides between us
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.owner, f)
            self.held = True
            return self
        raise RunDirBusy(f"{self.path}: another run took the lock while this one started; one run per output folder")

    def release(self) -> None:
        if self.held and _read(self.path).get("pid") == self.owner["pid"]:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
        self.held = False


def acquire(output_dir: str) -> Callable[[], None]:
    """Take ``output_dir``'s lock; returns its release (for a run's closers)."""
    return RunLock(output_dir).acquire().release


def _metrics_lines(output_dir: str) -> int:
    path = os.path.join(output_dir, "metrics.jsonl")
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def output_problems(cfg: Any) -> List[str]:
    """What a run with ``cfg`` would overwrite or cannot resume (empty: nothing)."""
    # heavy (torch, Megatron): not for the lock alone, which the tests take from fresh interpreters
    from megatron_rl.training.checkpoint import latest_checkpoint, list_checkpoints

    out: List[str] = []
    busy = busy_problem(cfg.output_dir)
    if busy:
        out.append(busy)
    pointer = os.path.join(cfg.checkpoint_root, "latest")
    if os.path.isdir(pointer):
        out.append(f"{pointer} is a directory, not the checkpoint pointer file; remove it (resume=true finds the "
                   "newest complete iter_* without it)")
    if cfg.overwrite:
        return out
    lines, steps = _metrics_lines(cfg.output_dir), list_checkpoints(cfg.checkpoint_root)
    try:
        resumable = cfg.resume and (cfg.resume_step is not None or latest_checkpoint(cfg.checkpoint_root) is not None)
    except ValueError:
        resumable = True  # a pointer naming a missing checkpoint: preflight's resume check names it
    if lines and not resumable:
        what = "resume=true finds no checkpoint to continue from" if cfg.resume else "a new run would truncate it"
        out.append(f"logging.output_dir={cfg.output_dir!r} holds another run's metrics.jsonl ({lines} lines) and "
                   f"{what}; pass --force (overwrite=true) to start over (deletes it), or choose another output_dir")
    if steps and cfg.resume and not resumable:
        out.append(f"{cfg.checkpoint_root} holds checkpoints (steps {steps}) but none can be resumed; pass --force "
                   "(overwrite=true) to start over, or resume_step=N")
    return out
