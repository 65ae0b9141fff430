"""Each step's line (metrics.jsonl, tensorboard, wandb) with timings, tokens/s and MFU, and its console summary."""

from __future__ import annotations

import logging
import os
from typing import Dict, Optional

from megatron_rl import config_io, perf
from megatron_rl.config import RunConfig
from megatron_rl.metrics import MetricsLogger, PhaseTimer, throughput
from megatron_rl.orchestration.activity import BusyMeter
from megatron_rl.orchestration.phases.health import EngineHealth
from megatron_rl.orchestration.rollout_phase import RolloutBatch
from megatron_rl.orchestration.trainer_group import TrainerGroup

logger = logging.getLogger(__name__)


class StepLog:
    def __init__(self, cfg: RunConfig, timer: PhaseTimer, trainers: TrainerGroup, flops: perf.ModelFlops,
                 meter: BusyMeter, health: EngineHealth, resume_step: Optional[int]):
        """``meter``: the engines' busy time measured by the driver (generation can overlap any phase)."""
        self.cfg, self.timer, self.flops, self.meter, self.health = cfg, timer, flops, meter, health
        self.devices = perf.run_devices(cfg)
        info = trainers.infos[0]
        self.peak_flops = info.get("peak_flops")  # the device peak (trainer rank 0's)
        if self.peak_flops:
            logger.info("MFU (perf/*mfu: a fraction of the peak, not %%): %.3f TFLOP/s peak per device (%s; %s); "
                        "%d trainer + %d engine device(s)%s", self.peak_flops / 1e12, info.get("device"),
                        info.get("source"), self.devices.trainer, self.devices.engine,
                        " (colocated)" if self.devices.colocated else "")
        self.metrics = MetricsLogger(cfg.logging, resume_step=resume_step,
                                     run_name=os.path.basename(os.path.abspath(cfg.output_dir)),
                                     config_dict=config_io.to_dict(cfg))

    def close(self) -> None:
        self.metrics.close()

    def replay_lost_row(self, step: int, row: Optional[Dict[str, float]]) -> None:
        """The resumed step's metrics line, if the interrupted run died between committing its checkpoint and
        writing the line (the checkpoint carries it)."""
        if row is None or not self.cfg.logging.jsonl or self.metrics.last_step == step:
            return
        self.metrics.log(step, {**row, **throughput(row, row)})
        logger.warning("step %d's metrics line was lost with the interrupted run: written from its checkpoint", step)

    def write(self, step: int, metrics: Dict[str, float], batch: Optional[RolloutBatch] = None) -> Dict[str, float]:
        metrics = {**metrics, **self.timer.finish_step()}
        metrics.update(throughput(metrics, metrics))
        metrics.update(self.health.metrics())
        metrics.update(perf.step_metrics(metrics, self.flops, self.devices, self.peak_flops,
                                         engine_busy_s=self.meter.since_last()))
        text = {}
        shown = self.cfg.logging.print_samples
        if batch is not None and batch.groups and shown:
            g = batch.groups[0]
            text["samples"] = "\n".join(f"{g.record.prompt_text!r} -> {t!r} (reward {r:g})"
                                        for t, r in list(zip(g.texts, g.rewards))[:shown])
        self.metrics.log(step, metrics, text)
        logger.info(console_line(step, self.cfg.steps, metrics, step <= self.cfg.warmup.steps))
        for line in text.get("samples", "").splitlines():
            logger.info("  sample: %s", line)
        return metrics


def console_line(step: int, steps: int, m: Dict[str, float], warmup: bool) -> str:
    parts = [f"step {step}/{steps}" + (" [warm-up]" if warmup and step else "")]
    for key, label, fmt in (("rollout/reward_mean", "reward", ".3f"), ("batch/reward_mean", "batch", ".3f"),
                            ("eval/reward_mean", "eval", ".3f"), ("train/loss", "loss", ".4f"),
                            ("logprobs/ref_kl_forward", "ref_kl_fwd", ".3f"),
                            ("logprobs/ref_kl_reverse", "ref_kl", ".3f"), ("logprobs/mismatch_k3", "mismatch_k3", ".1e"),
                            ("rollout/groups_kept", "groups", ".0f"), ("time/step", "s", ".1f")):
        if key in m:
            parts.append(f"{label} {m[key]:{fmt}}")
    phases = [f"{k[5:]} {v:.1f}" for k, v in m.items() if k.startswith("time/") and k != "time/step" and v >= 0.05]
    return " | ".join(parts) + (f" ({', '.join(phases)})" if phases else "")
