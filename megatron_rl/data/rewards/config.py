"""The reward's part of the config tree (``reward.*``), validated when constructed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional

RewardKind = Literal["math", "exact_match", "custom"]
_KINDS = ("math", "exact_match", "custom")
# Below this an interpreter plus sympy (math-verify) cannot even start under RLIMIT_AS.
MIN_MEMORY_LIMIT_MB = 256
DEFAULT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ExactMatchOptions:
    """How response and label are normalised before ``==`` (``kind="exact_match"``)."""

    strip: bool = True                # drop leading/trailing whitespace
    collapse_whitespace: bool = True  # runs of whitespace inside -> one space
    ignore_case: bool = False


@dataclass(frozen=True)
class RewardConfig:
    """Which reward function runs, and how it is isolated.

    kind:            ``"math"`` (math-verify: response and label parsed and compared symbolically),
                     ``"exact_match"`` (normalised string equality, see ``exact_match``) or
                     ``"custom"`` (``custom_fn``).
    custom_fn:       ``"package.module:function"`` or ``"path/to/file.py:function"``; the function is
                     called as ``fn(response_text, label, **sample_info) -> float`` (keyword arguments it
                     does not accept are not passed).
    timeout_s:       per-sample wall-clock limit of the worker processes (``None``: 10 s); the worker
                     running a sample past it is killed and replaced, and the sample fails. An in-process
                     reward cannot be stopped, so setting it with ``in_process=True`` is refused.
    num_workers:     reward worker processes (started once, reused across batches).
    memory_limit_mb: ``RLIMIT_AS`` of each worker (address space, so it also bounds what model-written
                     code run by a reward can allocate); ``None`` for no limit.
    failure_reward:  the reward of a sample whose reward raised, timed out, returned a non-finite or
                     non-numeric value, or whose worker died.
    in_process:      run in the calling process instead: no process overhead, but no timeout and no
                     memory limit — for trivial, trusted rewards only (e.g. exact match).
    progress_min_batch: show a progress bar for batches at least this large.
    """

    kind: RewardKind = "math"
    custom_fn: Optional[str] = None
    timeout_s: Optional[float] = None
    num_workers: int = 4
    memory_limit_mb: Optional[int] = 4096
    failure_reward: float = 0.0
    in_process: bool = False
    exact_match: ExactMatchOptions = field(default_factory=ExactMatchOptions)
    progress_min_batch: int = 256

    @property
    def worker_timeout_s(self) -> float:
        return DEFAULT_TIMEOUT_S if self.timeout_s is None else float(self.timeout_s)

    def __post_init__(self) -> None:
        if isinstance(self.exact_match, dict):  # from YAML
            object.__setattr__(self, "exact_match", ExactMatchOptions(**self.exact_match))
        if self.kind not in _KINDS:
            raise ValueError(f"reward.kind={self.kind!r}: expected one of {_KINDS}")
        if self.kind == "custom":
            if not self.custom_fn or not isinstance(self.custom_fn, str) or ":" not in self.custom_fn:
                raise ValueError(f"reward.custom_fn={self.custom_fn!r}: kind='custom' needs "
                                 "'package.module:function' or 'path/to/file.py:function'")
        elif self.custom_fn is not None:
            raise ValueError(f"reward.custom_fn={self.custom_fn!r} is set but reward.kind={self.kind!r}; "
                             "set kind='custom' to use it, or remove custom_fn")
        if self.timeout_s is not None and (isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float))
                                           or not self.timeout_s > 0 or math.isinf(self.timeout_s)):
            raise ValueError(f"reward.timeout_s={self.timeout_s!r}: expected a finite number of seconds > 0")
        if self.in_process and self.timeout_s is not None:
            raise ValueError(f"reward.timeout_s={self.timeout_s} cannot be enforced with reward.in_process=true (a reward "
                             "running in the driver cannot be stopped); set in_process=false to run it in worker "
                             "processes with that timeout, or remove timeout_s")
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ValueError(f"reward.num_workers={self.num_workers!r}: expected an integer >= 1")
        if self.memory_limit_mb is not None and (
                isinstance(self.memory_limit_mb, bool) or not isinstance(self.memory_limit_mb, int)
                or self.memory_limit_mb < MIN_MEMORY_LIMIT_MB):
            raise ValueError(f"reward.memory_limit_mb={self.memory_limit_mb!r}: expected None (no limit) or an "
                             f"integer >= {MIN_MEMORY_LIMIT_MB} (a worker interpreter needs that much address space)")
        if not isinstance(self.failure_reward, (int, float)) or not math.isfinite(self.failure_reward):
            raise ValueError(f"reward.failure_reward={self.failure_reward!r}: expected a finite number")
        if isinstance(self.progress_min_batch, bool) or not isinstance(self.progress_min_batch, int) \
                or self.progress_min_batch < 1:
            raise ValueError(f"reward.progress_min_batch={self.progress_min_batch!r}: expected an integer >= 1")
