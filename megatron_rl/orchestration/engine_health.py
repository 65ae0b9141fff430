"""Engine recovery: a dead or hung rollout engine is restarted, given the trainer's current weights and
re-admitted to the balancer only after its probe check passes; its requests go to the other engines
meanwhile, or wait for it when it is the only one.

Detection (one watcher thread per engine; nothing is sent to a healthy engine, so rollouts are unchanged):

* dead: the server process exited -- its exit status is polled every ``poll_s`` through the engine's
  handle (the :class:`~megatron_rl.orchestration.engine_worker.EngineWorker` actor), or the balancer
  reports that a request could not reach the server;
* hung: requests in flight on it and none answered for ``stall_s``, or an unreachable server whose process
  still runs: a ``/health`` probe (SGLang and our server generate one token and answer 503 when the engine
  makes no progress) fails or gets no answer within ``health_timeout_s``. A server that passes it goes
  back into rotation (a transient).

Recovery of engine ``i``: out of rotation (the balancer took it out when it saw the failure) -> the handle
kills what is left (SIGKILL) and launches the server again on a fresh port, so nothing that knows the old
address reaches it early -> ``resync(i, url)``: the trainer's current weights to that server alone, then
the probe check (``TrainerGroup.sync_engine``) -> the balancer's client ``i`` points to the new URL and
takes requests again. A failed launch or sync counts as one more restart.

The balancer re-sends a request whose server could not be reached to an available server, or waits for
one. Seeded samples are a pure function of (run seed, step, round, slot, sample index), so a re-sent
request gives the same tokens on any server holding the same weights: a run whose engine is killed trains
on the samples of the uninterrupted run (log-probs can move by float rounding, ~1e-6, as with any change of
batching). With an overlapping ``rollout.mode`` (one_step, async) a restart during a rollout gets the trainer's newest
weights, one version ahead of the other engines; its samples carry that version (``rollout/staleness``).

Holds: while the driver itself makes engines unresponsive (memory released for colocated training, a weight
sync) nothing is judged by ``/health`` and nothing restarts; an exit seen meanwhile is recovered when the
hold ends (a restarted colocated engine must not take accelerator memory while the trainer runs). Liveness is
still watched then: a server whose processes are stopped (SIGSTOP; read from ``/proc`` by its handle, no request)
is killed within ``poll_s`` + 1 s, so a call waiting on it fails at once, and it is recovered like a crashed one.
Every control call the driver makes meanwhile is bounded by ``rollout.control_timeout_s`` (a hung server that
still runs: the call fails, the server is reported, ``/health`` judges it when the hold ends). A hold
waits for running recoveries first. After a failed weight sync, :meth:`EngineMonitor.recover_all` checks
every engine, recovers the broken ones and tells the caller whether a retry makes sense.

Giving up: a restart beyond ``max_restarts`` within ``window_s`` for one engine raises
:class:`EngineRecoveryError` naming the engine, what happened and its log tail -- in requests waiting for
an engine and in the driver's next phase. An engine's Ray actor that died (its node is gone) is not
replaced: that is an error too.

Metrics (cumulative over the run; a resumed run counts from zero): ``engine/restarts``,
``engine/out_seconds`` (time engines spent out of rotation), ``engine/resent_requests``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Deque, Dict, List, Optional, Protocol, Sequence

import ray

from megatron_rl.config import RecoveryConfig
from megatron_rl.orchestration.failures import RunError, actor_death
from megatron_rl.rollout.client.balancer import RemoteEngine
from megatron_rl.rollout.client.proc_state import STOPPED

log = logging.getLogger(__name__)


class EngineRecoveryError(RunError):
    """An engine could not be brought back (too many restarts, or its actor is gone); reported in one line."""


class EngineHandle(Protocol):
    """What the monitor needs from an engine's supervisor: ``ActorEngine`` (an ``EngineWorker`` itself in tests)."""

    def exit_status(self) -> Optional[str]:
        """None while the server process runs, else how it ended."""

    def restart(self) -> str:
        """Kill what is left of the server, launch it again on a fresh port; the new URL once it is healthy."""

    def log_tail(self) -> str:
        """The last lines of the server's log, with the log's path."""

    def kill(self) -> None:
        """SIGKILL the server (a stopped one, so that calls waiting on it fail now)."""


class ActorEngine:
    """:class:`EngineHandle` over an :class:`~megatron_rl.orchestration.engine_worker.EngineWorker` actor."""

    def __init__(self, actor, index: int, call_timeout_s: float = 60.0):
        self.actor, self.index, self.call_timeout_s = actor, index, call_timeout_s

    def _get(self, ref, timeout: Optional[float]):
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.RayActorError as e:
            dead = actor_death(f"engine {self.index}'s worker (its Ray actor)", {}, "a health check", e)
            raise EngineRecoveryError(f"{dead}; an engine worker is not replaced during a run (was it killed, or its "
                                      "node lost?)") from None

    def exit_status(self) -> Optional[str]:
        try:
            return self._get(self.actor.exit_status.remote(), self.call_timeout_s)
        except ray.exceptions.GetTimeoutError:
            log.warning("engine %d: its actor did not answer within %.0f s", self.index, self.call_timeout_s)
            return None

    def restart(self) -> str:
        return self._get(self.actor.restart.remote(), None)  # bounded by the launch's own health timeout

    def log_tail(self) -> str:
        try:
            return self._get(self.actor.log_tail.remote(), self.call_timeout_s)
        except Exception as e:  # noqa: BLE001 - the tail is extra information
            return f"(no log tail: {e})"

    def kill(self) -> None:
        self._get(self.actor.kill.remote(), self.call_timeout_s)


class Hold:
    """A hold on an :class:`EngineMonitor` (:meth:`EngineMonitor.hold`); released once."""

    def __init__(self, monitor: "EngineMonitor"):
        self._monitor: Optional[EngineMonitor] = monitor

    def release(self) -> None:
        if self._monitor is not None:
            self._monitor._unhold()
            self._monitor = None

    def __enter__(self) -> "Hold":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class EngineMonitor:
    """Watches the servers of ``engine`` (the driver's balancer), restarting through ``handles[i]`` and
    re-syncing with ``resync(i, url) -> str`` (a line for the log, e.g. the probe result). See the module doc."""

    def __init__(self, engine: RemoteEngine, handles: Sequence[EngineHandle], resync: Callable[[int, str], str],
                 config: RecoveryConfig = RecoveryConfig()):
        if len(handles) != len(engine.clients):
            raise ValueError(f"{len(handles)} engine handles for {len(engine.clients)} servers")
        self.engine, self.handles, self.resync, self.config = engine, list(handles), resync, config
        n = len(handles)
        self._cv = threading.Condition()
        self._down: List[Optional[str]] = [None] * n  # why engine i is out (None: up)
        self._reports: Dict[int, BaseException] = {}  # unreachable servers reported by the balancer
        self._wake = [threading.Event() for _ in range(n)]
        self._restarts: List[Deque[float]] = [collections.deque() for _ in range(n)]
        self._holds = 0
        self._recovering = 0
        self._stopped = False
        self.error: Optional[EngineRecoveryError] = None
        self.restarts = 0
        self.out_seconds = 0.0
        self._resent_logged = [0] * n
        self._threads = [threading.Thread(target=self._watch, args=(i,), name=f"engine-health-{i}", daemon=True)
                         for i in range(n)]
        engine.on_failure = self.report

    def start(self) -> "EngineMonitor":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        for e in self._wake:
            e.set()
        self.engine.on_failure = None
        for t in self._threads:
            if t.ident is not None:
                t.join(timeout=5)

    # ---- the driver's side ---------------------------------------------------------------------------

    def report(self, i: int, error: BaseException) -> None:
        """The balancer could not reach server ``i`` (it took it out of rotation)."""
        with self._cv:
            self._reports[i] = error
        self._wake[i].set()

    def hold(self, why: str) -> "Hold":
        """The driver makes the engines unresponsive on purpose (``why``): no judging and no restarts until
        ``.release()`` (or the end of a ``with`` block). Waits for running recoveries first."""
        with self._cv:
            while self._recovering and self.error is None and not self._stopped:
                self._cv.wait()
            self._holds += 1
        log.debug("engine health: hold (%s)", why)
        return Hold(self)

    def _unhold(self) -> None:
        with self._cv:
            self._holds -= 1
            self._cv.notify_all()
        for e in self._wake:
            e.set()  # what was seen during the hold is recovered now

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def fail_engine(self, i: int, reason: str) -> None:
        """Engine ``i`` failed a step of a weight-sync transaction (its weights may be partial): out of rotation now,
        restarted and re-admitted only after its own verified sync."""
        self._mark_down(i, reason)

    def recover_all(self) -> int:
        """Check every engine now (exit status and ``/health``), recover the broken ones and wait until all are
        back; returns how many were out. For a phase that failed (a weight sync): 0 means the engines are not
        why."""
        out = 0
        for i in range(len(self.handles)):
            with self._cv:
                if self._down[i] is not None:
                    out += 1
                    continue
            reason = self._diagnose(i, probe=True)
            if reason is not None:
                self._mark_down(i, reason)
                out += 1
        self.wait_all_up()
        return out

    def wait_all_up(self) -> None:
        with self._cv:
            while any(d is not None for d in self._down) and self.error is None and not self._stopped:
                self._cv.wait()
        self.raise_if_failed()

    def metrics(self) -> Dict[str, float]:
        return {"engine/restarts": float(self.restarts), "engine/out_seconds": self.out_seconds,
                "engine/resent_requests": float(sum(self.engine.resent))}

    # ---- watchers --------------------------------------------------------------------------------------

    def _watch(self, i: int) -> None:
        while True:
            self._wake[i].wait(self.config.poll_s)
            self._wake[i].clear()
            if self._stopped or self.error is not None:
                return
            try:
                if self._down[i] is None:
                    reason = self._diagnose(i, probe=False)
                    if reason is not None:
                        self._mark_down(i, reason)
                if self._down[i] is not None:
                    self._recover(i)
            except Exception as e:  # noqa: BLE001 - a watcher must not die silently
                if self._stopped:
                    return  # the run is tearing the engines down
                if not isinstance(e, EngineRecoveryError):
                    log.exception("engine %d: health check failed", i)
                    e = EngineRecoveryError(f"engine {i}: the health monitor failed: {type(e).__name__}: {e}")
                self._give_up(e)
                return

    def _diagnose(self, i: int, probe: bool) -> Optional[str]:
        """Why engine ``i`` must be restarted, or None. ``probe``: ask ``/health`` even without a suspicion."""
        status = self._exit_status(i)
        if status is not None:
            return f"its server process {status}"
        with self._cv:
            if self._holds:
                return None  # the driver made it unresponsive: judged after the hold (the report is kept)
            reported = self._reports.pop(i, None)
        if reported is not None:
            why = f"a request could not reach it ({reported})"
        elif self.engine.stalled(i, self.config.stall_s):
            why = f"requests in flight and none answered for {self.config.stall_s:.0f} s"
        elif probe or not self.engine.available[i]:
            why = "checked"
        else:
            return None
        client = self.engine.clients[i]
        if client.health(timeout_s=self.config.health_timeout_s):
            with self._cv:
                if self._down[i] is not None:
                    return None  # its watcher is restarting it meanwhile
                if not self.engine.available[i]:
                    log.warning("engine %d (%s): %s, but it is alive and healthy: back in rotation", i, client.url, why)
                self.engine.set_available(i, True)  # also restarts its stall clock
            return None
        status = self._exit_status(i)  # it may have died while we asked
        return (f"its server process {status}" if status is not None else
                f"hung: {why}; /health failed or did not answer within {self.config.health_timeout_s:.0f} s")

    def _exit_status(self, i: int) -> Optional[str]:
        """The handle's exit status; a server seen stopped (SIGSTOP) is killed at once, even during a hold: the
        calls waiting on it (a weight sync, a memory hand-over) then fail now instead of at their timeouts, and
        its restart waits for the hold's end like a crashed server's."""
        status = self.handles[i].exit_status()
        if status is not None and status.startswith(STOPPED):
            log.warning("engine %d (%s): its server process %s: killing it (it would hold every call to it)", i,
                        self.engine.clients[i].url, status)
            self.handles[i].kill()
        return status

    def _mark_down(self, i: int, reason: str) -> None:
        with self._cv:
            if self._down[i] is not None:
                return
            self._down[i] = reason
        self.engine.set_available(i, False)
        log.warning("engine %d (%s): %s; out of rotation, restarting it", i, self.engine.clients[i].url, reason)
        self._wake[i].set()

    def _recover(self, i: int) -> None:
        with self._cv:
            while self._holds and not self._stopped:
                self._cv.wait()
            if self._stopped:
                return
            self._recovering += 1
            reason = self._down[i]
        start = time.monotonic()
        try:
            while True:
                self._count_restart(i, reason)
                old = self.engine.clients[i].url
                try:
                    tic = time.monotonic()
                    url = self.handles[i].restart()
                    launched = time.monotonic() - tic
                    tic = time.monotonic()
                    synced = self.resync(i, url)
                    break
                except EngineRecoveryError:
                    raise
                except Exception as e:  # noqa: BLE001 - counted as one more restart
                    reason = f"its restart failed: {type(e).__name__}: {e}"
                    log.warning("engine %d: %s", i, reason)
            self.engine.replace_server(i, url)
            out = time.monotonic() - start
            with self._cv:
                self.out_seconds += out
                self._down[i] = None
                self._reports.pop(i, None)
            resent, self._resent_logged[i] = self.engine.resent[i] - self._resent_logged[i], self.engine.resent[i]
            log.warning("engine %d back in rotation after %.1f s out: restarted at %s (was %s) in %.1f s, %s in %.1f s; "
                        "%d of its requests were re-sent", i, out, url, old, launched, synced, time.monotonic() - tic,
                        resent)
        finally:
            with self._cv:
                self._recovering -= 1
                self._cv.notify_all()

    def _count_restart(self, i: int, reason: str) -> None:
        now, window = time.monotonic(), self._restarts[i]
        while window and now - window[0] > self.config.window_s:
            window.popleft()
        if len(window) >= self.config.max_restarts:
            raise EngineRecoveryError(
                f"engine {i} ({self.engine.clients[i].url}): {reason}; it was restarted {len(window)} time(s) in the "
                f"last {self.config.window_s:.0f} s and rollout.recovery.max_restarts={self.config.max_restarts}: "
                f"giving up. Its server's {self.handles[i].log_tail()}")
        window.append(now)
        with self._cv:
            self.restarts += 1

    def _give_up(self, error: EngineRecoveryError) -> None:
        with self._cv:
            if self.error is None:
                self.error = error
                log.error("%s", error)
            self._cv.notify_all()
        self.engine.fail(self.error)
