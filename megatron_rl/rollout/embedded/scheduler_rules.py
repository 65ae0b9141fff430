"""SGLang 0.5.23 scheduler rules the embedded double enforces, including the ones that kill SGLang.

* :func:`fully_idle` is ``Scheduler.is_fully_idle(ignore_waiting=paused)`` (``managers/scheduler.py:5337-5367``):
  nothing running -- requests held by an ``in_place`` pause are running, ``retract``-ed ones are waiting -- and,
  unless generation is paused, nothing waiting. ``/flush_cache`` (``:5518-5547``) and every flushing weight
  update need it; SGLang answers "Flush cache failed" otherwise.
* What is fatal on SGLang -- an exception in the scheduler process, which then sends SIGQUIT to the server
  (``scheduler.py:6370-6373``) -- raises :class:`SchedulerCrash` here: the server answers 500 and stops serving
  (connections are refused from then on; the ``main()`` process exits 1). These are: ``/resume_memory_occupation``
  of a tag that is not released (``offload_tags.remove`` -> ``KeyError``), ``/release_memory_occupation`` while not
  idle, also while paused in place with requests held (the assert, ``scheduler_components/weight_updater.py:
  337-346, 383-390``), and a seeded ``min_p > 0`` request under ``--enable-deterministic-inference`` (the
  sampler's assert, ``layers/sampler.py:829-833``).
"""

from __future__ import annotations

from typing import Iterable, Set

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")


class SchedulerCrash(RuntimeError):
    """SGLang's scheduler would raise here and take the whole server down (module doc)."""


def fully_idle(queue, engine) -> bool:
    """SGLang's ``is_fully_idle(ignore_waiting=paused)`` over the double's generation queue and engine."""
    running = queue.running and not engine.retracted
    return not running and (engine.paused or not queue.waiting)


def check_release(queue, engine) -> None:
    if not fully_idle(queue, engine):
        raise SchedulerCrash("AssertionError: release_memory_occupation should be called only when server is idle.")


def check_resume(released: Set[str], tags: Iterable[str]) -> None:
    for tag in tags:
        if tag not in released:
            raise SchedulerCrash(f"KeyError: {tag!r} (resume_memory_occupation of a memory tag that is not released)")
