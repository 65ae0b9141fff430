"""A parent-death guard for a run's local Ray.

``ray.init()`` starts gcs_server and raylet fate-shared with the driver, but the raylet's own children (the
dashboard and runtime-env agents) outlive a driver killed with SIGKILL for 90 s or more, still holding
their ports, and a SIGKILL'd driver cannot clean up after itself. So before starting Ray the driver marks
its environment with a per-run token (every process Ray starts inherits it: gcs, raylet, agents, workers,
and what the workers start) and starts this guard: a small process that blocks on a pipe from the driver.
The pipe closes however the driver ends; the guard then SIGKILLs every process still carrying the token
(found through ``/proc/<pid>/environ``; Linux only, elsewhere the guard is not started).

    python -m megatron_rl.orchestration.ray_guard TOKEN DRIVER_PID
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from typing import List, Optional

ENV = "MEGATRON_RL_RUN_TOKEN"


def marked_pids(token: str) -> List[int]:
    """Processes whose environment carries ``ENV=token`` (those this user may read)."""
    needle = f"{ENV}={token}".encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append(int(name))
        except OSError:  # gone, or not ours
            continue
    return out


def kill_marked(token: str, exclude: List[int]) -> List[int]:
    killed = []
    for pid in marked_pids(token):
        if pid in exclude:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except OSError:
            pass
    return killed


class Guard:
    """The driver's side: marks this process's environment and starts the guard; :meth:`release` (after
    ``ray.shutdown()``) lets it sweep what is left and exit."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        self.proc: Optional[subprocess.Popen] = None
        if not sys.platform.startswith("linux"):
            return
        os.environ[ENV] = self.token
        # its own session: a Ctrl-C or SIGTERM to the driver's process group must not stop it before the driver
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, self.token, str(os.getpid())],
                                     stdin=subprocess.PIPE, start_new_session=True)

    def release(self) -> None:
        os.environ.pop(ENV, None)
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None


def main(argv: List[str]) -> int:
    token, driver = argv[0], int(argv[1])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    while sys.stdin.buffer.read(65536):  # EOF: the driver released us, or died
        pass
    kill_marked(token, exclude=[os.getpid(), driver])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
