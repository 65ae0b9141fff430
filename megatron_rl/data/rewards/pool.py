"""A pool of reward worker processes with per-sample timeouts.

Why not ``concurrent.futures.ProcessPoolExecutor``: it cannot stop one running task. A hung reward
would hold its worker forever, and killing the process by hand marks the whole executor broken. Here
each worker has its own pipe and runs one sample at a time, so the parent knows which sample each
worker holds and since when: a sample past ``timeout_s`` gets its worker killed (SIGKILL) and
replaced, a worker that dies (segfault, OOM kill, ``os._exit``) fails only its own sample, and the
batch goes on with the others.

Workers are separate interpreters started with ``subprocess`` (``python -m
megatron_rl.data.rewards.worker``), talking over a private socket pair wrapped in a
``multiprocessing.connection.Connection``. Not ``fork``: forking a trainer process (CUDA context, NCCL,
tokenizer and Ray threads) is unsafe. Not ``multiprocessing``'s ``spawn``/``forkserver`` either: they
re-import the parent's ``__main__`` in the child, which re-runs a training script that lacks an
``if __name__ == "__main__"`` guard and fails outright for a script read from stdin. Workers start once
and serve batch after batch; a replacement joins when it reports ready, so its start-up time never
counts against a sample's timeout.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from megatron_rl.data.rewards.config import RewardConfig

# Where `megatron_rl` lives, put first on the worker's PYTHONPATH so `python -m` finds this very copy.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# A worker that has not reported ready by then (slow imports on a loaded machine count) is a config or
# environment problem, reported as such instead of waited on forever.
START_TIMEOUT_S = 120.0

Task = Tuple[str, Any, Dict[str, Any]]  # (response_text, label, sample_info)


@dataclass
class Outcome:
    """What happened to one sample: a value, or a failure ``kind`` ("exception" | "timeout" |
    "worker_died") with a human-readable ``error``."""

    value: Optional[Any] = None  # a float, or a tuple of floats (per-token rewards)
    kind: Optional[str] = None
    error: Optional[str] = None


@dataclass
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    started: float
    ready: bool = False
    task: Optional[int] = None
    deadline: float = float("inf")


class RewardWorkerPool:
    """``config.num_workers`` worker processes running ``config``'s reward; see the module docstring."""

    def __init__(self, config: RewardConfig):
        self.config = config
        self._workers: List[_Worker] = []
        self.restarts = 0  # workers replaced after a timeout or a death, over the pool's life
        # Kill workers if the pool is garbage-collected or the interpreter exits without close().
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)

    # -- lifecycle ---------------------------------------------------------------------------------

    def _spawn(self) -> _Worker:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        # num_workers processes already run in parallel; a BLAS thread pool per worker would oversubscribe
        # the cores and reserve per-thread buffers that count against RLIMIT_AS.
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(var, "1")
        try:
            proc = subprocess.Popen([sys.executable, "-m", "megatron_rl.data.rewards.worker", str(theirs.fileno())],
                                    pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
        finally:
            theirs.close()  # the child holds its copy; with ours closed, its death reads as EOF here
        conn = Connection(ours.detach())
        # The worker rebuilds the reward from the config and sees the same import path as we do (a
        # custom_fn module may sit on a directory added to sys.path at run time).
        conn.send((self.config, list(sys.path)))
        return _Worker(proc, conn, started=time.monotonic())

    @staticmethod
    def _kill(worker: _Worker) -> None:
        if worker.proc.poll() is None:
            worker.proc.kill()
        try:
            worker.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # unkillable (D state); do not block the run on it
            pass
        worker.conn.close()

    def _replace(self, worker: _Worker) -> None:
        self._kill(worker)
        self._workers[self._workers.index(worker)] = self._spawn()
        self.restarts += 1

    def close(self) -> None:
        """Ask idle workers to exit, kill the rest. The pool restarts its workers if used again."""
        for w in self._workers:
            if w.task is None:
                try:
                    w.conn.send(None)
                except OSError:
                    pass
        deadline = time.monotonic() + 2.0
        for w in self._workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            self._kill(w)
        self._workers.clear()

    # -- running a batch ---------------------------------------------------------------------------

    def run(self, tasks: Sequence[Task], on_done: Optional[Callable[[int], None]] = None) -> List[Outcome]:
        """Score every task; ``outcomes[i]`` belongs to ``tasks[i]``. Per-sample failures are outcomes,
        not exceptions; this raises only if workers cannot start at all (then all workers are killed)."""
        try:
            return self._run(tasks, on_done)
        except BaseException:
            # Leave no worker holding a sample of this batch: the next batch starts from a clean pool.
            _kill_all(self._workers)
            raise

    def _run(self, tasks: Sequence[Task], on_done: Optional[Callable[[int], None]]) -> List[Outcome]:
        outcomes: List[Optional[Outcome]] = [None] * len(tasks)
        pending = deque(range(len(tasks)))
        left = len(tasks)
        while len(self._workers) < self.config.num_workers:
            self._workers.append(self._spawn())

        def finish(i: int, outcome: Outcome) -> None:
            nonlocal left
            outcomes[i] = outcome
            left -= 1
            if on_done is not None:
                on_done(i)

        while left:
            for w in self._workers:
                if w.ready and w.task is None and pending:
                    self._dispatch(w, pending, tasks, finish)
            self._wait_and_collect(finish)
            self._enforce_deadlines(finish)
        return outcomes  # type: ignore[return-value]

    def _dispatch(self, w: _Worker, pending: deque, tasks: Sequence[Task], finish: Callable) -> None:
        i = pending.popleft()
        response, label, info = tasks[i]
        try:
            w.conn.send((i, response, label, info))
        except (BrokenPipeError, ConnectionResetError, EOFError):
            pending.appendleft(i)  # the worker died while idle; its replacement will take the sample
            self._replace(w)
            return
        except Exception as exc:  # the sample itself cannot be pickled (pickling precedes any write)
            finish(i, Outcome(kind="exception", error=f"cannot send sample to worker: {type(exc).__name__}: {exc}"))
            return
        w.task, w.deadline = i, time.monotonic() + self.config.timeout_s

    def _wait_and_collect(self, finish: Callable) -> None:
        now = time.monotonic()
        deadlines = [w.deadline for w in self._workers if w.task is not None]
        deadlines += [w.started + START_TIMEOUT_S for w in self._workers if not w.ready]
        timeout = max(0.0, min(deadlines) - now) if deadlines else None
        fired = set(wait([w.conn for w in self._workers], timeout))  # a dead worker's socket reads as EOF
        for w in list(self._workers):
            if w.conn in fired:
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):
                    self._on_death(w, finish)
                    continue
                self._on_message(w, msg, finish)

    def _on_message(self, w: _Worker, msg: Tuple, finish: Callable) -> None:
        if msg[0] == "ready":
            w.ready = True
        elif msg[0] == "init_error":
            raise RuntimeError(f"a reward worker failed to start: {msg[1]}. Check reward.kind/custom_fn; a "
                               "MemoryError here means reward.memory_limit_mb is too small for the imports")
        else:
            task_id, value, error = msg
            assert task_id == w.task, (task_id, w.task)  # one sample in flight per worker
            w.task, w.deadline = None, float("inf")
            finish(task_id, Outcome(value=value) if error is None else Outcome(kind="exception", error=error))

    def _on_death(self, w: _Worker, finish: Callable) -> None:
        try:
            code = w.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        if not w.ready:
            raise RuntimeError(f"a reward worker exited with code {code} before it was ready")
        if w.task is not None:
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            finish(w.task, Outcome(kind="worker_died", error=f"reward worker died ({how}) while scoring"))
        self._replace(w)

    def _enforce_deadlines(self, finish: Callable) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            if w.task is not None and now >= w.deadline:
                i = w.task
                self._replace(w)  # SIGKILL: a hung reward does not get to clean up, and cannot block us
                finish(i, Outcome(kind="timeout", error=f"reward did not finish within reward.timeout_s="
                                                        f"{self.config.timeout_s} s; worker killed and replaced"))
            elif not w.ready and now >= w.started + START_TIMEOUT_S:
                raise RuntimeError(f"a reward worker did not start within {START_TIMEOUT_S:.0f} s")


def _kill_all(workers: List[_Worker]) -> None:
    for w in workers:
        RewardWorkerPool._kill(w)
    workers.clear()
