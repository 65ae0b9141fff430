"""A rollout server run as a child process: launch, wait for ``/health``, restart, stop, log tail.

Used for SGLang (``sglang.py``) and for the embedded server in a subprocess (tests, CPU runs). The child
starts in its own session so ``stop``/``kill`` reach its workers (SGLang forks TP schedulers) through its
process group -- only the group this object started, by id.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from megatron_rl.rollout.client.http_client import RetryPolicy, SGLangClient
from megatron_rl.rollout.client.proc_state import stopped_in_group

log = logging.getLogger(__name__)


class ServerLaunchError(RuntimeError):
    """The server exited or did not become healthy in time; the message ends with its log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (another process could take it before we bind: launch soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ManagedServer:
    def __init__(self, argv: List[str], url: str, log_path: str, env: Optional[Dict[str, str]] = None,
                 health_timeout_s: float = 600.0, name: str = "rollout server", cwd: Optional[str] = None):
        self.argv, self.url, self.log_path = list(argv), url, Path(log_path)
        self.env = env
        self.health_timeout_s = health_timeout_s
        self.name, self.cwd = name, cwd
        self.proc: Optional[subprocess.Popen] = None
        self.restarts = 0
        self._probe = SGLangClient(url, timeout_s=5.0, retry=RetryPolicy(max_attempts=1))

    def __enter__(self) -> "ManagedServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "ManagedServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n==== {time.strftime('%H:%M:%S')} launching: {' '.join(self.argv)}\n".encode())
            logf.flush()
            self.proc = subprocess.Popen(self.argv, stdout=logf, stderr=subprocess.STDOUT, env=self.env,
                                         cwd=self.cwd, start_new_session=True)
        self.wait_healthy()
        return self

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.health_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerLaunchError(f"{self.name} exited with code {self.proc.returncode} before becoming "
                                        f"healthy. Last lines of {self.log_path}:\n{self.log_tail()}")
            if self._probe.health(timeout_s=2.0):
                return
            time.sleep(0.2)
        self.stop()
        raise ServerLaunchError(f"{self.name} not healthy at {self.url}/health after {self.health_timeout_s:.0f} s. "
                                f"Last lines of {self.log_path}:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stopped(self) -> List[int]:
        """The server's processes (its own session's group) stopped by SIGSTOP: it cannot answer."""
        return stopped_in_group(self.proc.pid) if self.alive() else []

    def restart(self) -> None:
        self.stop()
        self.restarts += 1
        self.start()

    def _signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, sig)  # the child's own session: its group id is its pid
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL without cleanup (what a crash looks like)."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"(no log: {e})"
        return "\n".join(text.splitlines()[-lines:])

    def client(self, retry: Optional[RetryPolicy] = None, **kwargs) -> SGLangClient:
        """A client wired to this process: with ``restart_dead_server`` it restarts a dead server."""
        return SGLangClient(self.url, retry=retry, restart=self.restart, is_alive=self.alive, **kwargs)


def launch_embedded_server(model_path: str, log_path: str, port: Optional[int] = None, host: str = "127.0.0.1",
                           seed: int = 0, deterministic: bool = True, health_timeout_s: float = 120.0,
                           extra_args: Optional[List[str]] = None, env: Optional[Dict[str, str]] = None) -> ManagedServer:
    """Start ``python -m megatron_rl.rollout.embedded.server`` for ``model_path`` and wait until it is healthy
    (``env``: variables set on top of this process's environment). A port we chose (``port=None``) can be taken by
    another process between choosing and binding: the launch then retries on a new port (up to 3 tries)."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    for attempt in range(1, 4):
        chosen = port or free_port(host)
        argv = [sys.executable, "-m", "megatron_rl.rollout.embedded.server", "--model-path", str(model_path),
                "--host", host, "--port", str(chosen), "--random-seed", str(seed),
                *(["--enable-deterministic-inference"] if deterministic else []), *(extra_args or [])]
        server = ManagedServer(argv, f"http://{host}:{chosen}", log_path, env=env, health_timeout_s=health_timeout_s,
                               name="embedded rollout server")
        try:
            return server.start()
        except ServerLaunchError as e:
            if port is not None or attempt == 3 or "Address already in use" not in str(e):
                raise
            log.warning("port %d was taken before the embedded rollout server bound it; trying another", chosen)
    raise AssertionError("unreachable")
