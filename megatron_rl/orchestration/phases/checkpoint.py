"""Checkpoints: the trainer's state + the driver's (step, sampler position, the rollout mode's state -- a
pending one-step rollout, the async stream's groups --, the step's metrics so far, written on resume if the
line itself was lost). At start-up either the latest one is restored (and the engines get its weights), or the
step-0 check compares engine and trainer log-probs of the probe."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Dict, Optional

from megatron_rl.config import RunConfig
from megatron_rl.config_io import ConfigError
from megatron_rl.data.sampler import PromptSampler
from megatron_rl.metrics import PhaseTimer
from megatron_rl.orchestration.modes import Rollouts
from megatron_rl.orchestration.phases.publish import WeightPublisher
from megatron_rl.orchestration.trainer_group import TrainerGroup
from megatron_rl.training.checkpoint import CheckpointConfig, latest_checkpoint

logger = logging.getLogger(__name__)
STATE_VERSION = 1


@dataclass(frozen=True)
class Restored:
    """Where the run starts: step 0, or a checkpoint's step with the driver's state saved with it."""

    step: int = 0
    resumed: bool = False
    rollout_state: Optional[dict] = None  # the rollout mode's state
    row: Optional[Dict[str, float]] = None  # the resumed step's metrics line


class Checkpointer:
    def __init__(self, cfg: RunConfig, trainers: TrainerGroup, publisher: WeightPublisher, sampler: PromptSampler,
                 timer: PhaseTimer):
        self.cfg, self.trainers, self.publisher, self.sampler, self.timer = cfg, trainers, publisher, sampler, timer
        self.batches: Optional[Rollouts] = None  # the rollout mode, whose state each checkpoint keeps (attach)

    def attach(self, batches: Rollouts) -> None:
        self.batches = batches

    def restore_or_check(self) -> Restored:
        cfg = self.cfg
        path = latest_checkpoint(cfg.checkpoint_root) if cfg.resume else None
        if cfg.resume and path is None:
            logger.warning("resume=true but %s holds no checkpoint: starting a new run", cfg.checkpoint_root)
        if path is None:
            if cfg.rollout.weight_sync.check:
                check = self.trainers.check_weights()  # step-0 numerics: engines and trainer on the same weights
                logger.info("step-0 check: engine vs trainer probe log-probs max |diff| %.2e over %d tokens",
                            check.max_abs_diff, check.length)
            return Restored()
        with self.publisher.trainer_state_loaded():
            loaded = self.trainers.load_checkpoint(cfg.checkpoint_root, cfg.resume_step)
        path = loaded.path
        state = loaded.extra["driver"]
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"{path}: driver state version {state.get('version')} != {STATE_VERSION}")
        for problem in loaded.skipped:
            logger.warning("%s; resuming from %s (step %d) instead: resume_step=N picks a checkpoint explicitly, "
                           "deleting the damaged one silences this", problem, os.path.basename(path), state["step"])
        try:
            self.sampler.load_state_dict(state["sampler"])
        except ValueError as e:  # e.g. data.path changed: the user's to fix, one line (the CLI's config error)
            raise ConfigError(f"resume=true from {path}: {e}") from None
        # "pending": a one-step rollout, as checkpoints written before rollout.mode stored it
        rollout_state = state.get("rollouts") or ({"pending": state["pending"]} if state.get("pending") else None)
        restored = Restored(state["step"], True, rollout_state, state.get("row"))
        # engines started from model.hf_path: give them the checkpoint's weights
        stats = self.trainers.sync_weights(version=restored.step)
        logger.info("resumed from %s at step %d (optimizer step %d); engines synced (probe max |dlogp| %.2e)",
                    path, restored.step, loaded.step, stats.check.max_abs_diff if stats.check else float("nan"))
        return restored

    def save(self, step: int, metrics: Optional[Dict[str, float]] = None, force: bool = False) -> bool:
        """Returns whether it saved (every ``checkpoint.interval`` steps, the last step, or ``force``)."""
        cfg, c = self.cfg, self.cfg.checkpoint
        if not (force or (c.interval and step % c.interval == 0) or step == cfg.last_step):
            return False
        ckpt = CheckpointConfig(root=cfg.checkpoint_root, keep_last=c.keep_last, save_optimizer=c.save_optimizer,
                                optimizer_format=c.optimizer_format)
        # Megatron loads the common state with torch.load(weights_only=True): plain types only (the rollout
        # modes pickle their records into bytes)
        row = {k: float(v) for k, v in (metrics or {}).items() if isinstance(v, (int, float))}
        row.update({f"time/{k}": v for k, v in self.timer.seconds.items()})
        state = {"version": STATE_VERSION, "step": step, "sampler": self.sampler.state_dict(),
                 "rollouts": self.batches.state_dict(), "row": row}
        with self.publisher.trainer_state_loaded(), self.timer.phase("checkpoint"):
            path = self.trainers.save_checkpoint(ckpt, {"driver": state}, step)
            if step == cfg.steps and c.save_hf:
                self.trainers.save_hf(os.path.join(cfg.output_dir, "hf_final"))
        logger.info("step %d: checkpoint %s", step, path)
        return True
