"""Named points of the run where tests inject faults: production code only announces them.

    hooks.fire("rollout", step=..., engine=..., monitor=...)      a step's rollout is about to start
    hooks.fire("before_sync", version=..., monitor=...)          engines up, right before a weight sync
    hooks.fire("engines_released", monitor=...)                  colocated engines released their memory (a hold)
    hooks.fire("after_checkpoint", step=...)                     the step's checkpoint is committed

Nothing is registered in a normal run, so each point costs a dictionary look-up. The fault injectors of the
reliability tests (``tests/fault_hooks.py``) register callbacks here before the run starts.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

Hook = Callable[..., None]
POINTS = ("rollout", "before_sync", "after_checkpoint", "engines_released")

_registry: Dict[str, List[Hook]] = {}


def register(point: str, hook: Hook) -> None:
    if point not in POINTS:
        raise ValueError(f"hooks.register: unknown point {point!r}; one of {POINTS}")
    _registry.setdefault(point, []).append(hook)


def clear() -> None:
    _registry.clear()


def fire(point: str, **context: Any) -> None:
    for hook in _registry.get(point, ()):
        hook(**context)
