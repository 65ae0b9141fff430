"""Run metrics: one ``metrics.jsonl`` line per step, tensorboard, optional wandb, phase timers, progress.

* :class:`MetricsLogger` writes every step's flat ``{name: float}`` dict to each enabled sink. On a
  resumed run it first cuts ``metrics.jsonl`` back to the resumed step (lines of steps the interrupted
  run logged after its last checkpoint are replayed, not duplicated) and tells tensorboard to purge
  them too. ``wandb`` is imported only when enabled, with a clear message when it is missing.
* :class:`PhaseTimer` times the driver's named phases; ``time/<phase>`` seconds per step, and the
  throughput figures (tokens/s) derived from them.
* :func:`progress` is a tqdm bar that is a no-op when progress bars are off.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from typing import Any, Dict, Iterator, Mapping, Optional

from tqdm.auto import tqdm

from megatron_rl.config import LoggingConfig


class MetricsLogger:
    def __init__(self, cfg: LoggingConfig, *, resume_step: Optional[int] = None, run_name: str = "",
                 config_dict: Optional[Mapping[str, Any]] = None):
        self.cfg = cfg
        os.makedirs(cfg.output_dir, exist_ok=True)
        self.jsonl_path = os.path.join(cfg.output_dir, "metrics.jsonl")
        self.last_step: Optional[int] = None  # the last step metrics.jsonl holds (after the cut)
        if cfg.jsonl:
            self.last_step = _truncate_jsonl(self.jsonl_path, keep_through=resume_step or 0)
        self._tb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a crashed run wrote after the checkpoint we resume from
            self._tb = SummaryWriter(os.path.join(cfg.output_dir, "tensorboard"),
                                     purge_step=None if resume_step is None else resume_step + 1)
        self._wandb = None
        if cfg.wandb:
            try:
                import wandb
            except ImportError:
                raise ImportError("logging.wandb=true but wandb is not installed: `pip install wandb`, or set "
                                  "logging.wandb=false") from None
            self._wandb = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name or run_name or None,
                                     config=dict(config_dict or {}), resume="allow", dir=cfg.output_dir)

    def log(self, step: int, metrics: Mapping[str, Any], text: Optional[Mapping[str, str]] = None) -> None:
        """Write step ``step``'s scalars (non-numbers are dropped from tensorboard/wandb)."""
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.cfg.jsonl:
            line = {"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in scalars.items()}}
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps(line, sort_keys=True) + "\n")
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            for k, v in (text or {}).items():
                self._tb.add_text(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _truncate_jsonl(path: str, keep_through: int) -> Optional[int]:
    """Keep only lines of steps <= ``keep_through`` (0: start a fresh file); returns the last step kept."""
    if not os.path.exists(path):
        return None
    kept, last = [], None
    if keep_through > 0:
        with open(path) as f:
            for line in f:
                try:
                    step = json.loads(line).get("step", 0)
                except ValueError:
                    continue  # a line torn by a crash
                if step <= keep_through:
                    kept.append(line)
                    last = step if last is None else max(last, step)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return last


# metrics that measure wall-clock time (and rates from it): they differ between otherwise identical runs
WALL_CLOCK = ("time/", "perf/", "sync/seconds", "sync/link", "sync/phase_seconds/")
# what engine recovery and the weight-sync transaction count: differs between a run with failures and one without
RECOVERY_COUNTERS = ("engine/", "sync/engines_", "sync/aborted")


def read_metrics(output_dir: str):
    """The ``metrics.jsonl`` lines of a run, as dicts (tests, tools)."""
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


class PhaseTimer:
    """``with timer.phase("rollout"): ...`` accumulates wall time per phase name within a step."""

    def __init__(self) -> None:
        self.seconds: Dict[str, float] = {}
        self._step_start = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def finish_step(self) -> Dict[str, float]:
        """``time/<phase>`` and ``time/step`` of the step just done; resets for the next one."""
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        out["time/step"] = time.perf_counter() - self._step_start
        self.seconds, self._step_start = {}, time.perf_counter()
        return out


def throughput(tokens: Mapping[str, float], times: Mapping[str, float]) -> Dict[str, float]:
    """tokens/s: generated tokens over rollout time, trained tokens over train time, all over the step."""
    out: Dict[str, float] = {}
    pairs = (("rollout_tokens_per_s", "rollout/response_tokens", "time/rollout"),
             ("train_tokens_per_s", "train/tokens", "time/train"),
             ("logprob_tokens_per_s", "train/tokens", "time/logprobs"),
             ("step_tokens_per_s", "train/tokens", "time/step"))
    for name, tok_key, time_key in pairs:
        t = times.get(time_key, 0.0)
        if tok_key in tokens and t > 0:
            out[f"perf/{name}"] = tokens[tok_key] / t
    return out


def progress(total: Optional[int], desc: str, enabled: bool, unit: str = "it", leave: bool = False,
             scale: bool = False):
    """``scale``: SI-prefixed counts (bytes as KiB/MiB...)."""
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, leave=leave, mininterval=0.5,
                dynamic_ncols=True, unit_scale=scale, unit_divisor=1024 if scale else 1000)
