"""Reward functions and the runner that isolates them.

  config.py   RewardConfig, ExactMatchOptions
  builtin.py  math_reward (math-verify), exact_match_reward
  resolve.py  "module:function" / "file.py:function" custom rewards; config -> callable
  worker.py   the worker process (RLIMIT_AS memory cap, scoring loop)
  pool.py     spawned workers with per-sample timeouts; hung workers killed and replaced
  runner.py   RewardRunner.compute_rewards -> RewardResult (failures counted, never raised)

Names are imported lazily (PEP 562) so that a worker process importing ``worker.py`` does not pull in
the runner's dependencies.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RewardConfig": "config", "ExactMatchOptions": "config",
    "math_reward": "builtin", "exact_match_reward": "builtin",
    "load_custom_fn": "resolve", "build_reward_fn": "resolve",
    "RewardRunner": "runner", "RewardResult": "runner", "compute_rewards": "runner", "FAILURE_KINDS": "runner",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
