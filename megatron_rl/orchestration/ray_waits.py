"""Bounded Ray waits for the driver's one-off calls (start-up, profiling): a worker that never answers ends the
run with a message naming the call, instead of a silent hang. The trainers' collective calls are bounded by the
heartbeat instead (``heartbeat.py``: a slow step is fine, a silent rank is not)."""

from __future__ import annotations

from typing import Any

import ray

from megatron_rl.orchestration.failures import RunError

SHORT_S = 120.0  # a call that does no real work (an address, device ids, a profiler switch)


def get(refs: Any, timeout_s: float, what: str) -> Any:
    """``ray.get(refs, timeout=timeout_s)``; a timeout is a :class:`RunError` naming ``what``."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RunError(f"{what}: no answer within {timeout_s:.0f} s (a worker is stopped, hung or its node is "
                       "overloaded)") from None
