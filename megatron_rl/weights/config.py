"""WeightSyncConfig: the ``weight_sync`` section of a run's config (torch only: the config tree imports it)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from megatron_rl.weights.group import dtype_from_name

MiB = 1 << 20


@dataclass
class WeightSyncConfig:
    """``bucket_mb``: bucket size limit (MiB, in the engine dtype). ``check_tolerance``: max |log-prob
    difference| allowed between engine and trainer on the probe (fp32 both sides: 1e-4; a bf16 engine
    against an fp32 trainer: ~0.25, see the module doc). ``probe_length`` is capped at the model's
    context - 1 and rounded down to a multiple of TP (sequence parallelism)."""

    bucket_mb: float = 512.0
    check: bool = True
    check_tolerance: Optional[float] = None  # max |diff|; None: 1e-4 for a float32 engine, 1.0 for bf16 / fp16
    check_mean_tolerance: Optional[float] = None  # mean |diff|; None: none for float32, 0.1 for bf16 / fp16
    probe_length: int = 256
    probe_seed: int = 0
    engine_dtype: Optional[str] = None  # None: an EmbeddedEngine's own dtype, else the trainer's params dtype
    progress: bool = True  # tqdm bar on the sender (bytes sent)
    replay_routing: bool = False  # MoE: the trainer's probe forward replays each engine's routing of the probe
    per_rank: bool = True  # every rank sends the pieces it owns to the sender (links.py); False: all-gather

    def __post_init__(self) -> None:
        if not (isinstance(self.bucket_mb, (int, float)) and math.isfinite(self.bucket_mb) and self.bucket_mb > 0):
            raise ValueError(f"weight_sync.bucket_mb={self.bucket_mb!r}: expected a size in MiB > 0 (e.g. 512)")
        for name in ("check_tolerance", "check_mean_tolerance"):
            tol = getattr(self, name)
            if tol is not None and not (isinstance(tol, (int, float)) and math.isfinite(tol) and tol > 0):
                raise ValueError(f"weight_sync.{name}={tol!r}: expected a finite number > 0 (or unset: chosen by "
                                 "the engine's dtype)")
        if not isinstance(self.probe_length, int) or self.probe_length < 2:
            raise ValueError(f"weight_sync.probe_length={self.probe_length!r}: expected an integer >= 2 tokens")
        if self.engine_dtype is not None:
            try:
                dtype_from_name(self.engine_dtype)
            except ValueError as e:
                raise ValueError(f"weight_sync.engine_dtype: {e}") from None

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * MiB))

    def tolerances(self, engine_dtype: torch.dtype) -> Tuple[float, Optional[float]]:
        """(max, mean) |log-prob difference| allowed for an engine holding ``engine_dtype`` weights."""
        exact = engine_dtype in (torch.float32, torch.float64)
        high = self.check_tolerance if self.check_tolerance is not None else (1e-4 if exact else 1.0)
        mean = self.check_mean_tolerance if self.check_mean_tolerance is not None else (None if exact else 0.1)
        return float(high), mean
