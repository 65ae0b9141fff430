"""A run's resources and its phase objects; the loop that calls the phases is ``driver.py``.

Start-up (:meth:`Run.__enter__`): output directory; tokenizer, prompt data and sampler; reward workers;
Ray, placement groups, trainer ranks and engine servers (started concurrently), the driver's
:class:`RemoteEngine` over the servers' URLs (``startup.py``); then the phases (``phases/``): either resume
(trainer checkpoint + the driver's state) followed by a weight sync, or the step-0 check that engines and
trainer agree on the probe's log-probs; then the rollout mode (``modes.py``: where each step's batch comes
from) and the engine health monitor (dead or hung engines are restarted and re-synced). Only a start that got
that far writes the resolved ``config.yaml`` (and, with ``overwrite``, removes the previous run's outputs): a
failed start leaves the output directory as it was.

Close: each phase's and resource's tear-down in reverse order, then the workers are asked to stop (after a
failure only briefly: a rank may hang in a collective), then killed; a local Ray is shut down.

The driver process owns everything that is not a tensor computation over the model: data, rewards,
advantages, logging. Trainers and engines are only reached through Ray calls and HTTP. Colocated engines
and trainers hand the GPUs to each other in the order of ``colocation.py``.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Callable, List, Optional

from megatron_rl import perf, run_dir
from megatron_rl.config import RunConfig, dump_yaml
from megatron_rl.config.checks import batch_unit
from megatron_rl.config_io import ConfigError
from megatron_rl.metrics import PhaseTimer
from megatron_rl.models.build import load_arch
from megatron_rl.orchestration import startup
from megatron_rl.orchestration.async_rollout import AsyncRollouts
from megatron_rl.orchestration.modes import OneStepRollouts, Rollouts
from megatron_rl.orchestration.phases.checkpoint import Checkpointer
from megatron_rl.orchestration.phases.evaluation import EvalPhase
from megatron_rl.orchestration.phases.health import EngineHealth
from megatron_rl.orchestration.phases.profile import Profiler
from megatron_rl.orchestration.phases.publish import WeightPublisher
from megatron_rl.orchestration.phases.step_log import StepLog
from megatron_rl.orchestration.phases.training import TrainingPhase
from megatron_rl.orchestration.rollout_phase import RolloutBatch, RolloutPhase
from megatron_rl.rollout.client import weight_files

logger = logging.getLogger(__name__)


class Run:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.timer = PhaseTimer()
        self.start_step = 0  # the last completed step (a checkpoint's, on resume)
        self.startup_seconds = 0.0
        self.data: Optional[startup.Data] = None
        self.cluster: Optional[startup.Cluster] = None
        # the phases, built by _start
        self.rollouts: Optional[RolloutPhase] = None  # generate -> rewards -> dynamic-sampling filter
        self.batches: Optional[Rollouts] = None  # where each step's batch comes from (rollout.mode)
        self.training: Optional[TrainingPhase] = None
        self.publisher: Optional[WeightPublisher] = None
        self.health: Optional[EngineHealth] = None
        self.checkpoints: Optional[Checkpointer] = None
        self.evaluation: Optional[EvalPhase] = None
        self.profiler: Optional[Profiler] = None
        self.log: Optional[StepLog] = None
        self._closers: List[Callable[[], None]] = []

    # ---- start-up / tear-down ---------------------------------------------------------------------------
    def __enter__(self) -> "Run":
        try:
            self._start()
        except BaseException:
            self.close(failed=True)
            raise
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(failed=exc_type is not None)

    def _start(self) -> None:
        cfg, timer = self.cfg, self.timer
        os.makedirs(cfg.output_dir, exist_ok=True)
        self._closers.append(run_dir.acquire(cfg.output_dir))  # one run per output folder, before any write
        problems = run_dir.output_problems(cfg)  # what the preflight saw may have changed since
        if problems:
            raise ConfigError(problems)
        weight_files.remove_stale()  # shared-memory weight files of ranks killed in an earlier run
        self.data = startup.start_data(cfg, self._closers)
        self._start_workers()
        cluster, trainers = self.cluster, self.cluster.trainers
        if cluster.colocation is not None:  # the trainer's optimizer state to host memory before any rollout
            cluster.colocation.start()
        self._start_rollouts()
        flops = perf.ModelFlops.from_arch(load_arch(cfg.model.hf_path))  # what MFU needs
        self.training = TrainingPhase(cfg, trainers, timer, flops)
        self.publisher = WeightPublisher(cfg, trainers, timer, cluster.colocation)
        self.checkpoints = Checkpointer(cfg, trainers, self.publisher, self.data.sampler, timer)
        restored = self.checkpoints.restore_or_check()
        self.start_step = restored.step
        self._prepare_output_dir()
        self.batches = self._rollout_mode(restored.rollout_state)
        self._closers.append(self.batches.close)
        self.checkpoints.attach(self.batches)
        self.health = EngineHealth(cfg, cluster.engine, cluster.placement.engines, self.publisher.resync_engine)
        self._closers.append(self.health.stop)
        self.publisher.attach_monitor(self.health.monitor)
        self.profiler = Profiler(cfg, trainers, cluster.placement.engines, timer)
        self.log = StepLog(cfg, timer, trainers, flops, self.rollouts.meter, self.health,
                           resume_step=restored.step if restored.resumed else None)
        self._closers.append(self.log.close)
        self.log.replay_lost_row(restored.step, restored.row)
        self.startup_seconds = timer.finish_step()["time/step"]  # reported once, not in step 1's time
        self.rollouts.meter.since_last()  # engine busy time is measured per step from here

    def _start_workers(self) -> None:
        self.cluster = startup.place_cluster(self.cfg)  # assigned first: close() shuts down what a failure left
        startup.connect(self.cfg, self.cluster, self.timer, self._closers)

    def _start_rollouts(self) -> None:
        cfg, data = self.cfg, self.data
        self.rollouts = RolloutPhase(cfg.rollout, self.cluster.engine, data.tokenizer, data.sampler, data.rewards,
                                     seed=cfg.seed, batch_unit=batch_unit(cfg), progress_bars=cfg.logging.progress,
                                     routing_replay=cfg.train.routing_replay)
        self._closers.append(self.rollouts.close)
        self.evaluation = EvalPhase(cfg, data.eval_datasets, self.rollouts, self.timer)

    def _prepare_output_dir(self) -> None:
        cfg = self.cfg
        if cfg.overwrite and not cfg.resume:
            # every output of the earlier run: a report/ or hf_final/ left beside new metrics would describe it
            for path in (cfg.checkpoint_root, *(os.path.join(cfg.output_dir, name) for name in
                                                ("tensorboard", "metrics.jsonl", "report", "hf_final"))):
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.remove(path)
        os.makedirs(cfg.output_dir, exist_ok=True)
        with open(os.path.join(cfg.output_dir, "config.yaml"), "w") as f:
            f.write(dump_yaml(cfg))

    def _rollout_mode(self, state: Optional[dict]) -> Rollouts:
        """``state``: the rollout mode's state restored from a checkpoint."""
        cfg = self.cfg
        if cfg.rollout.mode == "one_step":
            return OneStepRollouts(self._collect, self.timer, cfg.steps, state)
        if cfg.rollout.mode == "async":
            return AsyncRollouts(cfg.rollout, self.rollouts, self.data.sampler, seed=cfg.seed, timer=self.timer,
                                 filters=lambda step: not self.training.is_warmup(step), start_step=self.start_step,
                                 state=state)
        return Rollouts(self._collect, self.timer)

    def _collect(self, step: int) -> RolloutBatch:
        """Rollout -> rewards -> dynamic-sampling filter (no filter during the imitation warm-up)."""
        if self.health is not None:  # None while a resumed one-step rollout starts, before the monitor
            self.health.before_rollout(step)
        return self.rollouts.collect(step, filter_groups=not self.training.is_warmup(step))

    def close(self, failed: bool = False) -> None:
        for close in reversed(self._closers):
            try:
                close()
            except Exception as e:  # noqa: BLE001 - keep tearing down
                logger.warning("while closing: %s", e)
        self._closers = []
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            cluster.shutdown(failed)
            weight_files.remove_stale()  # a rank killed while its weight file was being read left it
