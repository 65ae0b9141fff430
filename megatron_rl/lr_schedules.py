"""Learning-rate schedules: warmup + constant / cosine, and the response-length-surge decay (§g).

A schedule is a small deterministic state machine stepped once per optimizer step. The LR must be the
same on every rank: the driver (controller) owns the schedule and pushes the LR to the trainers
(:func:`set_lr`), or — in SPMD code — every rank steps it with the same *global* input
(:func:`megatron_rl.objectives.reduce.global_mean_response_length`) and the result is broadcast from
one rank (:func:`megatron_rl.objectives.reduce.broadcast_scalar`). Its state is saved and restored
with checkpoints (``state_dict`` / ``load_state_dict``) so a resumed run reproduces the LR sequence.

Length-surge decay (constants from the paper's appendix as reported by a reproduction, §g.1):
warmup k_w steps to lr₀; baseline L_base = mean response length over steps 0..K_b−1 (warmup
included); the first step k >= K_b with L̄_k > κ·L_base (on ``patience`` consecutive steps) is the
surge step k_s; the period is P = max(P_min, ⌈1.8·k_s⌉); then
η_k = max(lr₀·½^{⌊(k−k_s)/P⌋}, floor_ratio·lr₀) (``decay_shape="step"``) or the smooth
lr₀·½^{(k−k_s)/P} (``"exponential"``). Response length = number of model-generated tokens
(tool/observation tokens excluded).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional

KINDS = ("constant", "cosine", "length_surge")


@dataclass(frozen=True)
class LRScheduleConfig:
    """LR schedule.

    Attributes:
        kind: ``constant``, ``cosine`` or ``length_surge`` (each after a linear warmup).
        lr: peak learning rate lr₀.
        warmup_steps: linear warmup η_k = lr₀ (k+1)/k_w for k < k_w.
        min_lr: cosine floor.
        total_steps: cosine horizon (required for ``cosine``).
        baseline_steps: K_b, steps whose mean response length form the baseline (from step 0).
        surge_factor: κ, surge when L̄_k > κ·L_base.
        period_factor: P = ⌈period_factor·k_s⌉.
        min_period: P_min, guards a very early surge.
        decay_factor: the LR is multiplied by this every P steps (0.5 = halving).
        floor_ratio: η never below floor_ratio·lr₀ after the surge.
        patience: consecutive surging steps required to trigger (1 = first step).
        cooldown_steps: minimum steps between two detections (``re_trigger`` only).
        decay_shape: ``step`` (⌊·⌋, the reproduction) or ``exponential`` (smooth).
        re_trigger: after the cooldown, a new surge relative to the length at the last detection restarts
            the decay from the current LR with k_s := k (not verified against the paper; off by default).
    """

    kind: str = "constant"
    lr: float = 1e-6
    warmup_steps: int = 0
    min_lr: float = 0.0
    total_steps: Optional[int] = None
    baseline_steps: int = 50
    surge_factor: float = 3.0
    period_factor: float = 1.8
    min_period: int = 1
    decay_factor: float = 0.5
    floor_ratio: float = 0.1
    patience: int = 1
    cooldown_steps: int = 50
    decay_shape: str = "step"
    re_trigger: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"LRScheduleConfig.kind={self.kind!r} is not one of {KINDS}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"LRScheduleConfig.lr={self.lr} must be a finite number > 0")
        if self.warmup_steps < 0:
            raise ValueError(f"LRScheduleConfig.warmup_steps={self.warmup_steps} must be >= 0")
        if not (math.isfinite(self.min_lr) and 0 <= self.min_lr <= self.lr):
            raise ValueError(f"LRScheduleConfig.min_lr={self.min_lr} must be in [0, lr={self.lr}]")
        if self.kind == "cosine" and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise ValueError(f"LRScheduleConfig.total_steps={self.total_steps} must be set and > warmup_steps="
                             f"{self.warmup_steps} for kind='cosine'")
        if self.baseline_steps < 1:
            raise ValueError(f"LRScheduleConfig.baseline_steps={self.baseline_steps} must be >= 1")
        if not self.surge_factor > 1:
            raise ValueError(f"LRScheduleConfig.surge_factor={self.surge_factor} must be > 1 (paper: 3)")
        if not self.period_factor > 0 or self.min_period < 1:
            raise ValueError(f"LRScheduleConfig.period_factor={self.period_factor} must be > 0 and min_period="
                             f"{self.min_period} >= 1")
        if not 0 < self.decay_factor < 1:
            raise ValueError(f"LRScheduleConfig.decay_factor={self.decay_factor} must be in (0, 1) (0.5 = halving)")
        if not 0 <= self.floor_ratio <= 1:
            raise ValueError(f"LRScheduleConfig.floor_ratio={self.floor_ratio} must be in [0, 1]")
        if self.patience < 1 or self.cooldown_steps < 0:
            raise ValueError(f"LRScheduleConfig.patience={self.patience} must be >= 1 and cooldown_steps="
                             f"{self.cooldown_steps} >= 0")
        if self.decay_shape not in ("step", "exponential"):
            raise ValueError(f"LRScheduleConfig.decay_shape={self.decay_shape!r} must be 'step' or 'exponential'")


@dataclass
class _SurgeState:
    step: int = 0
    phase: str = "warmup"  # warmup | constant | decay
    length_sum: float = 0.0  # Σ L̄_k over the baseline window
    length_count: int = 0
    base_length: Optional[float] = None  # L_base
    streak: int = 0  # consecutive surging steps
    surge_step: Optional[int] = None  # k_s
    period: Optional[int] = None  # P
    decay_start_lr: Optional[float] = None  # LR the current decay starts from
    last_detect: Optional[int] = None
    ref_length: Optional[float] = None  # L̄ at the last detection (re-trigger reference)


class LRSchedule:
    """``lr = schedule.step(mean_response_length)`` once per optimizer step (k = 0, 1, ...).

    ``mean_response_length`` is required by ``length_surge`` (global over the step) and ignored otherwise.
    """

    def __init__(self, cfg: LRScheduleConfig):
        self.cfg = cfg
        self.state = _SurgeState(phase="warmup" if cfg.warmup_steps > 0 else "constant")
        self.last_lr: Optional[float] = None

    # -- public -------------------------------------------------------------------------------
    def step(self, mean_response_length: Optional[float] = None) -> float:
        cfg, st = self.cfg, self.state
        k = st.step
        if cfg.kind == "length_surge":
            if mean_response_length is None or not math.isfinite(mean_response_length):
                raise ValueError(f"LRSchedule.step: kind='length_surge' needs a finite mean_response_length at step "
                                 f"{k}, got {mean_response_length!r}")
            self._observe(k, float(mean_response_length))
        lr = self._lr(k)
        st.step += 1
        if st.phase == "warmup" and st.step >= cfg.warmup_steps:
            st.phase = "constant" if st.surge_step is None else "decay"
        self.last_lr = lr
        return lr

    def metrics(self) -> Dict[str, float]:
        """The length-surge state for the step's metrics (none for other kinds): ``schedule/decaying`` (1 in
        the decay phase), ``schedule/surge_threshold`` (the mean length that counts as a surge now) and
        ``schedule/base_length``, once the baseline window is over."""
        cfg, st = self.cfg, self.state
        if cfg.kind != "length_surge":
            return {}
        out = {"schedule/decaying": float(st.phase == "decay")}
        if st.base_length is not None:
            out["schedule/base_length"] = st.base_length
            ref = st.base_length if st.surge_step is None else st.ref_length
            if st.surge_step is None or cfg.re_trigger:
                out["schedule/surge_threshold"] = cfg.surge_factor * ref
        return out

    def state_dict(self) -> Dict[str, Any]:
        return {"config": asdict(self.cfg), "state": asdict(self.state), "last_lr": self.last_lr}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if sd["config"] != asdict(self.cfg):
            changed = {k: (sd["config"].get(k), v) for k, v in asdict(self.cfg).items() if sd["config"].get(k) != v}
            raise ValueError(f"LRSchedule.load_state_dict: the checkpoint's schedule config differs (saved, now): "
                             f"{changed}; resume with the saved config or start a new schedule")
        self.state = _SurgeState(**sd["state"])
        self.last_lr = sd["last_lr"]

    # -- internals ------------------------------------------------------------------------------
    def _observe(self, k: int, length: float) -> None:
        cfg, st = self.cfg, self.state
        if k < cfg.baseline_steps:
            st.length_sum += length
            st.length_count += 1
            if k == cfg.baseline_steps - 1:
                st.base_length = st.length_sum / st.length_count
            return
        if st.surge_step is None:
            surging = length > cfg.surge_factor * st.base_length
        elif cfg.re_trigger and k - st.last_detect >= cfg.cooldown_steps:
            surging = length > cfg.surge_factor * st.ref_length
        else:
            st.streak = 0
            return
        st.streak = st.streak + 1 if surging else 0
        if st.streak >= cfg.patience:
            st.decay_start_lr = cfg.lr if st.surge_step is None else self._decay_lr(k)
            st.surge_step, st.last_detect, st.ref_length, st.streak = k, k, length, 0
            # round first: 1.8 * 110 = 198.00000000000003 in floating point, and the period must be 198
            st.period = max(cfg.min_period, math.ceil(round(cfg.period_factor * k, 9)))
            if st.phase != "warmup":
                st.phase = "decay"

    def _decay_lr(self, k: int) -> float:
        cfg, st = self.cfg, self.state
        periods = (k - st.surge_step) / st.period
        if cfg.decay_shape == "step":
            periods = math.floor(periods)
        return max(st.decay_start_lr * cfg.decay_factor ** periods, cfg.floor_ratio * cfg.lr)

    def _lr(self, k: int) -> float:
        cfg, st = self.cfg, self.state
        if k < cfg.warmup_steps:
            return cfg.lr * (k + 1) / cfg.warmup_steps
        if cfg.kind == "cosine":
            progress = min(1.0, (k - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps))
            return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
        if cfg.kind == "length_surge" and st.surge_step is not None:
            return self._decay_lr(k)
        return cfg.lr


def set_lr(optimizer, lr: float) -> None:
    """Write ``lr`` into every param group (times its ``lr_mult`` when Megatron set one)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
