"""A parent-death guard for a run's local Ray.

``ray.init()`` starts gcs_server and raylet fate-shared with the driver, but the raylet's own children (the
dashboard and runtime-env agents) outlive a driver killed with SIGKILL for 90 s or more, still holding
their ports, and a SIGKILL'd driver cannot clean up after itself. So the driver starts this guard: a small
process that blocks on a pipe from the driver, which closes however the driver ends. The guard then
SIGKILLs what is left of the run (Linux only; elsewhere it is not started), found two ways because Ray's
processes rename themselves (``setproctitle`` overwrites their command line and environment block):

* every process holding a file open under the Ray session directory (each Ray process logs there), which
  the driver sends down the pipe once Ray is up;
* every process whose environment carries the run's token (``MEGATRON_RL_RUN_TOKEN``, inherited by all the
  driver starts: reward workers, servers started by engine workers).

    python -m megatron_rl.orchestration.ray_guard TOKEN DRIVER_PID
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from typing import Iterable, List, Optional

from megatron_rl.orchestration import guard_sweep as sweep
from megatron_rl.orchestration.guard_sweep import read_until_eof

ENV = "MEGATRON_RL_RUN_TOKEN"


def _holds_file_under(pid: str, dirs: Iterable[str]) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if any(target.startswith(d) for d in dirs):
            return True
    return False


def _has_token(pid: str, token: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{ENV}={token}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def run_pids(token: str, dirs: List[str]) -> List[int]:
    """The processes of the run (those this user may inspect)."""
    dirs = [os.path.join(os.path.abspath(d), "") for d in dirs]
    return [int(pid) for pid in os.listdir("/proc")
            if pid.isdigit() and (_has_token(pid, token) or (dirs and _holds_file_under(pid, dirs)))]


def kill_run(token: str, dirs: List[str], exclude: List[int]) -> List[int]:
    killed = []
    for pid in run_pids(token, dirs):
        if pid in exclude:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except OSError:
            pass
    return killed


class Guard:
    """The driver's side: marks this process's environment and starts the guard; :meth:`watch` tells it the
    Ray session directory; :meth:`release` (after ``ray.shutdown()``) lets it sweep what is left and exit."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        self.proc: Optional[subprocess.Popen] = None
        if not sys.platform.startswith("linux"):
            return
        os.environ[ENV] = self.token
        # its own session: a Ctrl-C or SIGTERM to the driver's process group must not stop it before the driver
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, self.token, str(os.getpid())],
                                     stdin=subprocess.PIPE, start_new_session=True)

    def watch(self, directory: str) -> None:
        if self.proc is not None:
            self.proc.stdin.write(os.path.abspath(directory).encode() + b"\n")
            self.proc.stdin.flush()

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
    dirs, tree = read_until_eof(sys.stdin.buffer.fileno(), driver)  # EOF: released, or the driver died
    if sweep.driver_alive(driver):  # released: the driver's other children are not the run's
        tree = {}
    sweep.freeze_and_kill(lambda: run_pids(token, [d for d in dirs if d]), tree, exclude={os.getpid(), driver})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
