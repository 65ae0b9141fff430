"""The reward worker process: limits itself, builds the reward function, then scores samples.

Run as ``python -m megatron_rl.data.rewards.worker FD`` by :mod:`megatron_rl.data.rewards.pool`: a
fresh interpreter, with no CUDA context, threads or locks inherited from the trainer, talking over the
socket ``FD``. This module stays light (no torch, no transformers) so a replacement worker starts
quickly and fits under the memory limit.

Wire protocol (pickled ``multiprocessing.connection`` messages):
  parent -> worker  ``(RewardConfig, sys_path)`` first
  worker -> parent  ``("ready", pid)`` once, or ``("init_error", message)`` and exit
  parent -> worker  ``(task_id, response_text, label, sample_info)`` or ``None`` (exit)
  worker -> parent  ``(task_id, value, None)`` or ``(task_id, None, "ExcType: message")``
"""

from __future__ import annotations

import os
import signal
import sys
from multiprocessing.connection import Connection
from typing import Optional

from megatron_rl.data.rewards.builtin import WORKER_ENV, reward_value

_MAX_ERROR_CHARS = 500


def apply_limits(memory_limit_mb: Optional[int]) -> None:
    """Cap this process's address space (``RLIMIT_AS``, soft and hard, so code run by the reward cannot
    raise it again) and disable core dumps. An allocation past the cap raises ``MemoryError`` in the
    allocating code instead of pushing the machine into swap or the OOM killer."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if memory_limit_mb is None:
        return
    limit = memory_limit_mb * 1024 * 1024
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _describe(exc: BaseException, memory_limit_mb: Optional[int] = None) -> str:
    text = type(exc).__name__ + (f": {exc}" if str(exc) else "")
    if isinstance(exc, MemoryError) and memory_limit_mb is not None:
        text += f" (over reward.memory_limit_mb={memory_limit_mb})"
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "..."


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the process that started it dies, even by SIGKILL — otherwise a
    worker stuck in a hung reward would outlive a crashed trainer. (Strictly: when the *thread* that
    started it exits; the pool then just sees a dead worker and replaces it.)"""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def worker_main(conn: Connection) -> None:
    _die_with_parent()
    os.environ[WORKER_ENV] = "1"
    # Ctrl-C goes to the whole process group; the parent decides what happens to workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        config, parent_sys_path = conn.recv()
        sys.path[:] = list(parent_sys_path) + [p for p in sys.path if p not in parent_sys_path]
        apply_limits(config.memory_limit_mb)
        from megatron_rl.data.rewards.resolve import build_reward_fn

        fn = build_reward_fn(config)
    except BaseException as exc:  # report any start-up failure instead of dying silently
        conn.send(("init_error", _describe(exc)))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # parent gone
            return
        if msg is None:
            return
        task_id, response, label, info = msg
        try:
            reply = (task_id, reward_value(fn(response, label, info)), None)
        except BaseException as exc:  # includes SystemExit from user code: report it, keep serving
            reply = (task_id, None, _describe(exc, config.memory_limit_mb))
        conn.send(reply)


if __name__ == "__main__":
    worker_main(Connection(int(sys.argv[1])))
