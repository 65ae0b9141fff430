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


def check_sampling_mask(req, cap: int) -> None:
    """SGLang refuses a ``return_sampling_mask`` request up front unless its top_k is 1 (greedy: SGLang sets it) or
    in ``[2, cap]`` (``managers/scheduler.py:3172-3182``): ValueError, a 400 for the whole batch."""
    if not req.return_sampling_logprobs:
        return
    top_k = 1 if req.sampling.greedy else req.sampling.top_k
    if top_k != 1 and not 1 < top_k <= cap:
        raise ValueError(f"return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= {cap}; "
                            f"got top_k={top_k}. Lower top_k or increase --sampling-mask-max-tokens.")


def check_resume(released: Set[str], tags: Iterable[str]) -> None:
    for tag in tags:
        if tag not in released:
            raise SchedulerCrash(f"KeyError: {tag!r} (resume_memory_occupation of a memory tag that is not released)")
