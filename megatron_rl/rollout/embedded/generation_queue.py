"""The embedded server's generation queue: requests -> rows -> batched engine calls, on one worker thread.

The worker starts on the first arrival, as SGLang's scheduler does: requests that come a few milliseconds
later join the running batch at the next decode step (below), so waiting for them would only delay every lone
request -- a weight-sync probe, a health check -- by the wait (a 10 ms gather made the 32-token probe take
16 ms instead of 3.5). ``gather_quiet_s`` / ``gather_max_s`` (default 0: off) still let a test make the worker
wait until arrivals pause for that long, or that long after the first.

Rows (one per sample) are pulled from the waiting jobs lazily and round-robin into the engine's running batch
(continuous batching, :meth:`EmbeddedEngine.generate_stream`): whenever rows finish, waiting rows take their
places at the next decode step, up to ``max_batch_rows``, and a job is answered as soon as its last row is done.
A large request costs memory per batch, not per request, and cannot starve the requests behind it.

Seeded sampling does not depend on batch composition, so batching changes no token; log-probs may move
by float rounding (~1e-6).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from typing import Deque, Iterator, List, Optional

from megatron_rl.rollout.client.protocol import GenerateRequest, Sample


class _Job:
    def __init__(self, requests: List[GenerateRequest], rows: Iterator):
        self.requests = requests
        self.rows = rows  # lazily built rows, request-major
        self.samples: List[Optional[Sample]] = []  # one slot per row pulled, in order
        self.running = 0  # rows in the current batch
        self.exhausted = False
        self.aborted_rids: set = set()
        self.abort_all = False
        self.done = threading.Event()
        self.error: Optional[BaseException] = None

    def finished(self) -> bool:
        return self.exhausted and self.running == 0


class GenerationQueue:
    def __init__(self, engine, gather_quiet_s: float = 0.0, gather_max_s: float = 0.0):
        self.engine = engine
        self.gather_quiet_s, self.gather_max_s = gather_quiet_s, gather_max_s
        self._jobs: Deque[_Job] = deque()
        self._cv = threading.Condition()
        self._paused = False
        self._stopped = False
        self._in_flight: dict = {}  # id(row) -> (job, slot) of the rows in the engine's batch
        self._thread = threading.Thread(target=self._work, name="generation-queue", daemon=True)
        self._thread.start()

    # ---- API ------------------------------------------------------------------------------------------

    def submit(self, requests: List[GenerateRequest], timeout_s: Optional[float] = None) -> List[Sample]:
        """Generate ``requests``; their samples, request-major. ``TimeoutError`` after ``timeout_s`` (the job
        is then aborted)."""
        job = _Job(requests, itertools.chain.from_iterable(self.engine.rows(r) for r in requests))
        with self._cv:
            # SGLang holds a request that arrives while generation is paused at the door (before it is
            # registered, so an abort_all does not reach it) until continue_generation
            while self._paused and not self._stopped:
                self._cv.wait()
            self._jobs.append(job)
            self._cv.notify_all()
        if not job.done.wait(timeout_s):
            self._abort_job(job)
            raise TimeoutError(f"no answer within {timeout_s} s")
        if job.error is not None:
            raise job.error
        return job.samples  # type: ignore[return-value]

    @property
    def busy(self) -> bool:
        """Requests are running or waiting (SGLang then refuses to flush its cache or release memory). Rows,
        not the worker: once the last row is delivered the server is idle, as SGLang's scheduler is, even while
        the decode loop winds down (the engine's lock serialises what comes next)."""
        with self._cv:
            return bool(self._jobs) or bool(self._in_flight)

    @property
    def running(self) -> bool:
        """Rows are in the engine's batch (held there too while paused)."""
        with self._cv:
            return bool(self._in_flight)

    @property
    def waiting(self) -> bool:
        """Jobs whose rows have not all joined the batch yet (SGLang's waiting queue)."""
        with self._cv:
            return any(not j.exhausted for j in self._jobs)

    def pause(self) -> None:
        with self._cv:
            self._paused = True

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def abort(self, rid: Optional[str], abort_all: bool) -> None:
        """Waiting rows of the matching jobs come back aborted (running ones: ``engine.abort``)."""
        with self._cv:
            for job in self._jobs:
                if abort_all:
                    job.abort_all = True
                elif rid is not None:
                    job.aborted_rids.add(rid)
            self._cv.notify_all()

    def _abort_job(self, job: _Job) -> None:
        with self._cv:
            job.abort_all = True
            self._cv.notify_all()
        for r in job.requests:
            if r.rid is not None:
                self.engine.abort(r.rid)

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            for job in self._jobs:
                job.abort_all = True
            self._cv.notify_all()
        self._thread.join(timeout=5)
        for job in list(self._jobs):  # whatever the worker did not finish
            job.error = job.error or RuntimeError("the server is shutting down")
            job.done.set()

    # ---- the worker -----------------------------------------------------------------------------------

    def _take_batch(self, limit: int) -> List[tuple]:
        """Up to ``limit`` (job, slot, row) taken round-robin from the waiting jobs; aborted rows are answered at
        once. Called with the lock held."""
        batch: List[tuple] = []
        active = [j for j in self._jobs if not j.exhausted]
        while active and len(batch) < limit:
            for job in list(active):
                row = next(job.rows, None)
                if row is None:
                    job.exhausted = True
                    active.remove(job)
                    continue
                slot = len(job.samples)
                job.samples.append(None)
                if job.abort_all or row.rid in job.aborted_rids:
                    job.samples[slot] = self.engine.aborted_sample(row)
                    continue
                job.running += 1
                batch.append((job, slot, row))
                if len(batch) >= limit:
                    break
        return batch

    def _finish_jobs(self) -> None:
        for job in [j for j in self._jobs if j.finished()]:
            self._jobs.remove(job)
            job.done.set()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and (self._paused or not self._jobs):
                    self._cv.wait()
                if self._stopped:
                    return
                self._gather()
                if self._stopped:
                    return
                if self._paused:
                    continue
            try:
                self.engine.generate_stream(self._take, self._deliver)
                error = None
            except BaseException as e:  # noqa: BLE001 - reported to every job: the next would meet it too
                error = e
            with self._cv:
                for job, _ in self._in_flight.values():
                    job.running -= 1
                    job.error = job.error or error or RuntimeError("the engine returned without answering a row")
                self._in_flight.clear()
                for job in self._jobs if error is not None else ():
                    job.error, job.exhausted = job.error or error, True
                self._finish_jobs()

    def _take(self, free: int) -> list:
        """The engine's call between decode steps: up to ``free`` rows to join its batch."""
        with self._cv:
            if self._paused or self._stopped:
                return []
            try:
                batch = self._take_batch(free)
            except BaseException as e:  # noqa: BLE001 - building rows failed: fail the waiting jobs
                for job in self._jobs:
                    if not job.exhausted:
                        job.error, job.exhausted = e, True
                batch = []
            for job, slot, row in batch:
                self._in_flight[id(row)] = (job, slot)
            self._finish_jobs()
            return [row for _, _, row in batch]

    def _deliver(self, row, sample: Sample) -> None:
        with self._cv:
            job, slot = self._in_flight.pop(id(row))
            job.samples[slot] = sample
            job.running -= 1
            self._finish_jobs()

    def _gather(self) -> None:
        """Wait (holding ``_cv``'s lock between waits) until arrivals pause; see the module doc."""
        if self.gather_max_s <= 0:
            return
        deadline = time.monotonic() + self.gather_max_s
        seen = len(self._jobs)
        while not self._stopped and not self._paused:
            remaining = min(self.gather_quiet_s, deadline - time.monotonic())
            if remaining <= 0:
                return
            self._cv.wait(remaining)
            if len(self._jobs) <= seen:  # nothing new for gather_quiet_s (or jobs were aborted)
                return
            seen = len(self._jobs)
