"""A run's resources and its phases, one method each; the loop that calls them is ``driver.py``.

Start-up (:meth:`Run.__enter__`): output directory; tokenizer, prompt data and sampler; reward workers;
Ray, placement groups, trainer ranks and engine servers (started concurrently); the driver's
:class:`RemoteEngine` over the servers' URLs; then either resume (trainer checkpoint + the driver's state:
step, sampler position, the rollout mode's state -- a pending one-step rollout, the async stream's groups --,
the step's metrics line) followed by a weight sync, or the step-0 check that engines and trainer agree on
the probe's log-probs; then the rollout mode (``modes.py``: where each step's batch comes from) and the
engine health monitor (``engine_health.py``: dead or hung engines are restarted and re-synced). Only a start that got that
far writes the resolved ``config.yaml`` (and, with ``overwrite``, removes the previous run's outputs): a
failed start leaves the output directory as it was.

Close: the workers are asked to stop (after a failure only briefly: a rank may hang in a collective),
then killed; a local Ray is shut down and its parent-death guard released.

The driver process owns everything that is not a tensor computation over the model: data, rewards,
advantages, logging. Trainers and engines are only reached through Ray calls and HTTP. Colocated engines
and trainers hand the GPUs to each other in the order of ``colocation.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import shutil
from typing import Any, Dict, Optional, Tuple

from megatron_rl import config_io, perf
from megatron_rl.config import RunConfig, dump_yaml
from megatron_rl.config_checks import batch_unit
from megatron_rl.metrics import MetricsLogger, PhaseTimer
from megatron_rl.objectives import ObjectiveConfig
from megatron_rl.orchestration import batching
from megatron_rl.orchestration.modes import OneStepRollouts, Rollouts
from megatron_rl.orchestration.rollout_phase import RolloutBatch, RolloutPhase

logger = logging.getLogger(__name__)
STATE_VERSION = 1


class Run:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.timer = PhaseTimer()
        self.start_step = 0
        self.rollout_state: Optional[dict] = None  # the rollout mode's state restored from a checkpoint
        self.batches: Rollouts = None  # where each step's batch comes from (rollout.mode)
        self.resumed = False
        self.placement = None
        self._local_ray = None  # the local Ray this run started (placement.LocalRay)
        self._replay_row: Optional[Dict[str, float]] = None  # the resumed step's metrics line, from the checkpoint
        self._release_hold = None
        self.recovery = None  # the EngineMonitor, when engines are launched here and rollout.recovery.enabled
        self.colocation = None  # colocated placement with engines launched here
        self._closers = []
        self._profiling: Optional[int] = None  # the step a profiler capture runs for

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
        cfg = self.cfg
        os.makedirs(cfg.output_dir, exist_ok=True)
        self._start_data()
        self._start_workers()
        if self.colocation is not None:  # the trainer's optimizer state to host memory before any rollout
            self.colocation.start()
        self._start_perf()
        self._restore_or_check()
        self._prepare_output_dir()
        self.batches = self._rollout_mode()
        self._closers.append(self.batches.close)
        self._start_recovery()
        self.metrics = MetricsLogger(cfg.logging, resume_step=self.start_step if self.resumed else None,
                                     run_name=os.path.basename(os.path.abspath(cfg.output_dir)),
                                     config_dict=config_io.to_dict(cfg))
        self._closers.append(self.metrics.close)
        self._replay_lost_row()
        self.startup_seconds = self.timer.finish_step()["time/step"]  # reported once, not in step 1's time
        self.rollouts.meter.since_last()  # engine busy time is measured per step from here

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

    def _start_data(self) -> None:
        from transformers import AutoTokenizer

        from megatron_rl.data.prompts import PromptDataset
        from megatron_rl.data.rewards.runner import RewardRunner
        from megatron_rl.data.sampler import PromptSampler

        cfg = self.cfg
        try:  # what --dry-run could not know without tokenising: an empty prompt, every prompt too long...
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
            self.dataset = PromptDataset(cfg.data, self.tokenizer)
            self.eval_datasets = {name: PromptDataset(d, self.tokenizer) for name, d in cfg.eval.named_datasets.items()}
            reward_cfg = cfg.reward
            if not cfg.logging.progress:  # the runner's own bar follows the run's switch
                reward_cfg = dataclasses.replace(reward_cfg, progress_min_batch=2**62)
            self.rewards = RewardRunner(reward_cfg)
        except ValueError as e:
            raise config_io.ConfigError(str(e)) from None
        self.sampler = PromptSampler.from_config(self.dataset)
        self._closers.append(self.rewards.close)
        logger.info("data: %s", self.dataset.stats)

    def _specs(self):
        from megatron_rl.orchestration.engine_worker import EngineSpec
        from megatron_rl.orchestration.trainer_worker import TrainerSpec

        cfg, r = self.cfg, self.cfg.rollout
        kl = cfg.train.objective.kl_penalty
        ref_lp = None
        if kl.coef > 0 and kl.estimator != "exact":  # sample-based KL needs log pi_ref of the sampled tokens
            ref_lp = cfg.train.reference_model or cfg.model
        # with routing replay, the post-sync probe replays each engine's routing of the probe too
        weight_sync = dataclasses.replace(cfg.rollout.weight_sync, replay_routing=cfg.train.routing_replay)
        if r.engine == "embedded" and weight_sync.engine_dtype is None:  # send what the engine holds
            weight_sync = dataclasses.replace(weight_sync, engine_dtype=r.embedded_dtype)
        trainer = TrainerSpec(model=cfg.model, train=cfg.train, optim=cfg.optim, layout=cfg.parallel.layout,
                              weight_sync=weight_sync, seed=cfg.model.seed,
                              threads=cfg.cluster.threads_per_worker, backend=cfg.cluster.backend,
                              ref_logprobs_model=ref_lp)
        engine = None
        if cfg.rollout.engine != "remote":
            engine = EngineSpec(kind=r.engine, model_path=cfg.model.hf_path, deterministic=r.deterministic_inference,
                                seed=cfg.seed, host=r.host,
                                threads=cfg.cluster.threads_per_worker, routed_experts=cfg.train.routing_replay,
                                dtype=r.embedded_dtype, log_dir=cfg.output_dir, sglang=r.sglang)
        return trainer, engine

    def _start_workers(self) -> None:
        import ray

        from megatron_rl.orchestration import placement
        from megatron_rl.orchestration.progress import maybe_board
        from megatron_rl.orchestration.trainer_group import TrainerGroup
        from megatron_rl.rollout.client.balancer import RemoteEngine
        from megatron_rl.rollout.client.http_client import SGLangClient

        cfg, r = self.cfg, self.cfg.rollout
        trainer_spec, engine_spec = self._specs()
        self._local_ray = placement.init_ray(cfg.cluster, placement.required_cpus(cfg.cluster, cfg.parallel.world_size, r))
        self.placement = placement.place(cfg.cluster, r, cfg.parallel.world_size, trainer_spec, engine_spec)
        url_refs = self._start_engines()  # engines load while trainers set up
        board = maybe_board(cfg.logging.progress)
        if board is not None:
            self._closers.append(board.close)
        self.trainers = TrainerGroup(self.placement.trainers, progress=board, work=self._dp_work())
        self.trainers.setup()
        urls = ray.get(url_refs) if url_refs else list(r.urls)
        logger.info("rollout servers: %s", urls)
        self.routing = None  # routing replay: the trainer's MoE layout, to decode and check engine routes
        layout = None
        if cfg.train.routing_replay:
            from megatron_rl.models.build import load_arch
            from megatron_rl.routing import RoutingLayout
            from megatron_rl.routing.align import expert_layout

            arch = load_arch(cfg.model.hf_path)
            self.routing = RoutingLayout.from_arch(arch)
            layout = expert_layout(arch)
        clients = [SGLangClient(u, timeout_s=r.request_timeout_s, expert_layout=layout, logprob_mode=r.logprob_mode,
                                max_in_flight=r.max_samples_in_flight)
                   for u in urls]
        self.engine = RemoteEngine(clients, policy=r.balancer, max_concurrency=r.max_concurrency)
        self._closers.append(self.engine.shutdown)
        self.trainers.connect_engines(urls, r.transport, r.balancer, r.request_timeout_s,
                                      pause_mode="in_place" if r.partial else None)
        if r.placement == "colocated" and self.placement.engines:
            from megatron_rl.orchestration.colocation import Colocation

            offload = r.offload_trainer if r.offload_trainer is not None else cfg.cluster.gpus_per_trainer > 0
            self.colocation = Colocation(self.engine, self.trainers, self.timer, offload_trainer=offload,
                                         check=r.weight_sync.check)
        unit = batch_unit(cfg)
        self.rollouts = RolloutPhase(r, self.engine, self.tokenizer, self.sampler, self.rewards, seed=cfg.seed,
                                     batch_unit=unit, progress_bars=cfg.logging.progress,
                                     routed_experts=cfg.train.routing_replay)
        self._closers.append(self.rollouts.close)
        from megatron_rl.orchestration.evaluate import Evaluator

        self.evaluator = (Evaluator(cfg.eval, self.eval_datasets, self.rollouts, cfg.seed)
                          if self.eval_datasets else None)

    def _start_engines(self) -> list:
        """Start every engine server (Ray refs of their URLs); colocated SGLang on its trainer ranks' GPUs."""
        import ray

        from megatron_rl.orchestration.placement import colocated_devices, engine_tp

        r, engines = self.cfg.rollout, self.placement.engines
        if not (r.engine == "sglang" and r.placement == "colocated"):
            return [e.start.remote() for e in engines]
        ids = ray.get([t.device_ids.remote() for t in self.placement.trainers])
        return [e.start.remote(d) for e, d in zip(engines, colocated_devices(ids, engine_tp(r), len(engines)))]

    def _dp_work(self):
        """With a token budget: the trainer's estimate of a sequence's work (lengths as packed under CP), by
        which the driver balances its data-parallel split; None: equal contiguous shards."""
        if not self.cfg.train.token_budget:
            return None
        import torch

        from megatron_rl.models.build import load_arch
        from megatron_rl.training.micro_batch import packed_lengths
        from megatron_rl.training.token_budget import WorkModel

        model, cp = WorkModel.from_arch(load_arch(self.cfg.model.hf_path)), self.cfg.parallel.cp
        return lambda lengths: model(packed_lengths(torch.tensor(lengths), cp).tolist())

    def _start_perf(self) -> None:
        """What MFU needs: the model's FLOPs per token, the devices, the device peak (trainer rank 0's)."""
        from megatron_rl.models.build import load_arch

        cfg = self.cfg
        self.flops = perf.ModelFlops.from_arch(load_arch(cfg.model.hf_path))
        self.devices = perf.run_devices(cfg)
        info = self.trainers.infos[0]
        self.peak_flops = info.get("peak_flops")
        if self.peak_flops:
            logger.info("MFU (perf/*mfu: a fraction of the peak, not %%): %.3f TFLOP/s peak per device (%s; %s); "
                        "%d trainer + %d engine device(s)%s",
                        self.peak_flops / 1e12, info.get("device"), info.get("source"), self.devices.trainer,
                        self.devices.engine, " (colocated)" if self.devices.colocated else "")

    def _restore_or_check(self) -> None:
        from megatron_rl.training.checkpoint import latest_checkpoint

        cfg = self.cfg
        path = latest_checkpoint(cfg.checkpoint_root) if cfg.resume else None
        if cfg.resume and path is None:
            logger.warning("resume=true but %s holds no checkpoint: starting a new run", cfg.checkpoint_root)
        if path is not None:
            with self._trainer_state_loaded():
                loaded = self.trainers.load_checkpoint(cfg.checkpoint_root, cfg.resume_step)
            path = loaded.path
            state = loaded.extra["driver"]
            if state.get("version") != STATE_VERSION:
                raise ValueError(f"{path}: driver state version {state.get('version')} != {STATE_VERSION}")
            for problem in loaded.skipped:
                logger.warning("%s; resuming from %s (step %d) instead: resume_step=N picks a checkpoint explicitly, "
                               "deleting the damaged one silences this", problem, os.path.basename(path), state["step"])
            self.sampler.load_state_dict(state["sampler"])
            self.start_step, self.resumed = state["step"], True
            # "pending": a one-step rollout, as checkpoints written before rollout.mode stored it
            self.rollout_state = state.get("rollouts") or ({"pending": state["pending"]} if state.get("pending")
                                                           else None)
            self._replay_row = state.get("row")
            # engines started from model.hf_path: give them the checkpoint's weights
            stats = self.trainers.sync_weights(version=self.start_step)
            logger.info("resumed from %s at step %d (optimizer step %d); engines synced (probe max |dlogp| %.2e)",
                        path, self.start_step, loaded.step, stats.check.max_abs_diff if stats.check else float("nan"))
        elif cfg.rollout.weight_sync.check:
            check = self.trainers.check_weights()  # step-0 numerics: engines and trainer on the same weights
            logger.info("step-0 check: engine vs trainer probe log-probs max |diff| %.2e over %d tokens",
                        check.max_abs_diff, check.length)

    def _start_recovery(self) -> None:
        from megatron_rl.orchestration import engine_health

        self._kill_plan = engine_health.kill_plan(os.environ.get(engine_health.KILL_ENV))
        r = self.cfg.rollout
        if not (r.recovery.enabled and self.placement.engines):
            return  # remote servers: nobody here can restart them
        if r.transport == "ipc":  # a restarted server would need the GPUs the trainer holds, and new IPC groups
            logger.warning("rollout.recovery: not available with the ipc weight transport (colocated SGLang); "
                           "a dead engine stops the run (resume=true continues from the last checkpoint)")
            return
        handles = [engine_health.ActorEngine(a, i) for i, a in enumerate(self.placement.engines)]
        self.recovery = engine_health.EngineMonitor(self.engine, handles, self._resync_engine,
                                                    self.cfg.rollout.recovery).start()
        self._closers.append(self.recovery.stop)

    def _resync_engine(self, index: int, url: str) -> str:
        """Engine recovery: the trainer's current weights to the restarted engine ``index``, and the probe check."""
        stats = self.trainers.sync_engine(index, url)
        check = (f"probe max |dlogp| {stats.check.max_abs_diff:.2e}" if stats.check is not None
                 else "no probe check (rollout.weight_sync.check=false)")
        return f"weights v{stats.version} ({stats.bytes / 2**20:.1f} MiB), {check}"

    def _replay_lost_row(self) -> None:
        """The resumed step's metrics line, if the interrupted run died between committing its checkpoint and
        writing the line (the checkpoint carries it)."""
        row, step = self._replay_row, self.start_step
        if row is None or not self.cfg.logging.jsonl or self.metrics.last_step == step:
            return
        from megatron_rl.metrics import throughput

        self.metrics.log(step, {**row, **throughput(row, row)})
        logger.warning("step %d's metrics line was lost with the interrupted run: written from its checkpoint", step)

    def _rollout_mode(self) -> Rollouts:
        cfg = self.cfg
        mode = cfg.rollout.mode
        if mode == "one_step":
            return OneStepRollouts(self.rollout, self.timer, cfg.steps, self.rollout_state)
        if mode == "async":
            from megatron_rl.orchestration.async_rollout import AsyncRollouts

            return AsyncRollouts(cfg.rollout, self.rollouts, self.sampler, seed=cfg.seed, timer=self.timer,
                                 filters=lambda step: not self.is_warmup(step), start_step=self.start_step,
                                 state=self.rollout_state)
        return Rollouts(self.rollout, self.timer)

    def close(self, failed: bool = False) -> None:
        for close in reversed(self._closers):
            try:
                close()
            except Exception as e:  # noqa: BLE001 - keep tearing down
                logger.warning("while closing: %s", e)
        self._closers = []
        try:
            if self.placement is not None:
                self.placement.shutdown(timeout_s=3.0 if failed else 30.0)
                self.placement = None
        finally:
            if self._local_ray is not None:
                self._local_ray.shutdown()
                self._local_ray = None

    # ---- phases -------------------------------------------------------------------------------------------
    def is_warmup(self, step: int) -> bool:
        return step <= self.cfg.warmup.steps

    def rollout(self, step: int) -> RolloutBatch:
        """Rollout -> rewards -> dynamic-sampling filter (no filter during the imitation warm-up)."""
        if self.recovery is not None:
            self.recovery.raise_if_failed()
            from megatron_rl.orchestration.engine_health import kill_when_busy

            for i in self._kill_plan.get((step, "rollout"), []):  # fault injection (tests): a crash mid-rollout
                kill_when_busy(self.engine, i, self.recovery.handles[i])
        return self.rollouts.collect(step, filter_groups=not self.is_warmup(step))

    def release_engines(self) -> Dict[str, float]:
        """Colocated: the engines free their memory for the trainer, which takes its state back (memory metrics).
        They get it back in :meth:`sync_weights`."""
        if self.colocation is None:
            return {}
        if self.recovery is not None:  # released engines answer no /health; restarts wait for the resume
            self._release_hold = self.recovery.hold("memory released")
        return self.colocation.to_training()

    def _trainer_state_loaded(self):
        """Colocated: the trainer's offloaded state on its GPUs (checkpoints read and write it)."""
        return self.colocation.trainer_state_loaded() if self.colocation is not None else contextlib.nullcontext()

    def resume_engines(self) -> None:
        """Whatever the engines still hold released (nothing after a sync) comes back."""
        if self.colocation is not None:
            self.colocation.resume()
        self._end_release_hold()

    def _end_release_hold(self) -> None:
        if self._release_hold is not None:
            self._release_hold.release()
            self._release_hold = None

    def logprobs(self, tb, step: int) -> Tuple[Any, Any, Dict[str, float]]:
        """Old (and reference) log-probs of the batch under the current weights."""
        objective = self.cfg.objective_at(step)
        with self.timer.phase("logprobs"):
            fwd = self.trainers.forward(tb, objective) if self._needs_forward(objective) else None
            ref = self.trainers.ref_logprobs(tb) if self.needs_ref_logprobs else None
        # forward passes: the policy's (+ its reference model's logits) and the sample-KL reference's
        passes = (0 if fwd is None else 1 + (self.cfg.train.reference_model is not None)) + (ref is not None)
        flops = {"perf/logprob_flops": passes * self._batch_flops(tb)}
        if fwd is None:
            return tb.replace(ref_logprobs=ref), None, flops
        tb = tb.replace(old_logprobs=fwd.logprobs, ref_logprobs=ref, routing_disagreement=fwd.routing_disagreement)
        return tb, fwd, {**batching.forward_metrics(tb, fwd, objective), **fwd.metrics, **flops}

    def _batch_flops(self, tb) -> float:
        """Forward FLOPs of the policy over the batch's sequences."""
        lengths = tb.seq_lengths.tolist()
        return self.flops.forward(float(sum(lengths)), perf.sum_sq(lengths))

    @property
    def needs_ref_logprobs(self) -> bool:
        kl = self.cfg.train.objective.kl_penalty
        return kl.coef > 0 and kl.estimator != "exact"

    def _needs_forward(self, objective: ObjectiveConfig) -> bool:
        cfg = self.cfg
        kl = objective.kl_penalty
        return (objective.policy.mode == "decoupled" or cfg.advantage.estimator == "otb" or cfg.diagnostics.gain
                or objective.dense_kl.beta > 0 or (kl.coef > 0 and kl.placement == "reward"))

    def advantages(self, tb, fwd, batch: RolloutBatch, step: int):
        with self.timer.phase("advantages"):
            rewards = [x for g in batch.groups for x in g.rewards]
            per_token = [t for g in batch.groups for t in (g.token_rewards or [None] * len(g.rewards))]
            adv, metrics = batching.compute_step_advantages(
                self.cfg.advantage, self.cfg.objective_at(step), tb, rewards, fwd,
                imitation_only=self.is_warmup(step), ref_logprobs=tb.ref_logprobs, per_token=per_token)
        return tb.replace(advantages=adv), metrics

    def train(self, tb, step: int) -> Dict[str, float]:
        with self.timer.phase("train"):
            result = self.trainers.train_step(tb, self.cfg.objective_at(step), version=step)
        out = {"train/grad_norm": result.grad_norm, "train/lr": result.lr,
               "train/skipped": float(result.skipped), "train/optimizer_step": float(result.step),
               "train/tokens": float(tb.seq_lengths.sum()), "train/sequences": float(tb.batch_size),
               "train/warmup": float(self.is_warmup(step))}
        if not result.skipped:  # a skipped step trained nothing: no loss to show
            out["train/loss"] = result.loss
        ref = dataclasses.replace(self.cfg.train, objective=self.cfg.objective_at(step)).needs_reference_logits
        out["perf/train_flops"] = (3 + ref) * self._batch_flops(tb)  # forward + backward (+ the reference's)
        out.update(result.metrics)
        return out

    def gain(self, tb, batch: RolloutBatch, step: int) -> Dict[str, float]:
        """``diagnostics.gain``: the update's gain decomposition (math_spec §h.3) from a forward of the same
        batch under the new weights against its old log-probs (``megatron_rl.diagnostics``)."""
        d = self.cfg.diagnostics
        if not d.gain or tb.old_logprobs is None:
            return {}
        from megatron_rl.diagnostics import gain_decomposition

        with self.timer.phase("diagnostics"):
            new = self.trainers.forward(tb, self.cfg.objective_at(step))
            rewards = [x for g in batch.groups for x in g.rewards]
            return {**gain_decomposition(rewards, tb.group_ids, tb.old_logprobs, new.logprobs, tb.response_mask,
                                         d.reward_max), "perf/diagnostics_flops": self._batch_flops(tb)}

    def sync_weights(self, step: int) -> Dict[str, float]:
        memory: Dict[str, float] = {}
        if self.colocation is not None and self.colocation.released and self.recovery is None:
            stats, memory = self.colocation.sync(step)  # the engines' memory comes back piece by piece around it
        else:
            self.resume_engines()  # with recovery: an engine answers /health only with all its memory back
            with self.timer.phase("weight_sync"):
                stats = self._sync_weights(step)
        out = {"sync/seconds": stats.seconds, "sync/mib": stats.bytes / 2**20, "sync/buckets": float(stats.buckets),
               **stats.link_metrics(prefix="sync/")}  # sync/link<r>/bytes, /gb_per_s: per sending trainer rank
        if stats.check is not None:
            out["sync/probe_max_abs_diff"] = stats.check.max_abs_diff
            out["sync/probe_mean_abs_diff"] = stats.check.mean_abs_diff
        return {**out, **memory}

    def _sync_weights(self, version: int):
        """With recovery: after the engines out of rotation are back; a sync that failed because an engine died or
        hung is retried once it is recovered."""
        if self.recovery is None:
            return self.trainers.sync_weights(version=version)
        from megatron_rl.orchestration.engine_health import EngineRecoveryError

        for attempt in itertools.count(1):
            self.recovery.wait_all_up()
            try:
                with self.recovery.hold("weight sync"):
                    for i in self._kill_plan.pop((version, "sync"), []):  # fault injection (tests)
                        logger.warning("fault injection: SIGKILL to engine %d's server before weight sync v%s", i, version)
                        self.recovery.handles[i].kill()
                    return self.trainers.sync_weights(version=version)
            except Exception as e:  # noqa: BLE001 - re-raised unless an engine failure explains it
                if isinstance(e, EngineRecoveryError) or attempt > self.cfg.rollout.recovery.max_restarts \
                        or not self.recovery.recover_all():
                    raise
                cause = getattr(e, "cause", None) or e  # a Ray task error: the trainer's exception
                logger.warning("weight sync v%s failed with an engine down (%s: %s); engines recovered, syncing again",
                               version, type(cause).__name__, (str(cause).strip().splitlines() or [""])[-1])

    def profile_start(self, step: int) -> None:
        """``profile.steps``: start torch-profiler captures on the chosen trainer ranks and the engines."""
        p = self.cfg.profile
        if step not in p.steps:
            return
        import ray

        d = p.step_dir(self.cfg.output_dir, step)
        opts = dict(record_shapes=p.record_shapes, with_stack=p.with_stack)
        with self.timer.phase("profile"):
            self.trainers.start_profile(p.trainer_ranks, lambda r: os.path.join(d, f"trainer_rank{r}.json"), **opts)
            if p.engines:
                ray.get([e.start_profile.remote(os.path.join(d, f"engine{i}"), **opts)
                         for i, e in enumerate(self.placement.engines)])
        self._profiling = step

    def profile_stop(self, step: int) -> None:
        if self._profiling != step:
            return
        import ray

        p = self.cfg.profile
        with self.timer.phase("profile"):
            self.trainers.stop_profile(p.trainer_ranks)
            if p.engines:
                ray.get([e.stop_profile.remote() for e in self.placement.engines])
        self._profiling = None
        logger.info("step %d: profiler traces in %s", step, p.step_dir(self.cfg.output_dir, step))

    def evaluate(self, step: int) -> Dict[str, float]:
        e = self.cfg.eval
        due = e.interval > 0 and (step % e.interval == 0 or step == self.cfg.steps)
        if self.evaluator is None or not due:
            return {}
        with self.timer.phase("eval"):
            return self.evaluator.run(step)

    def checkpoint(self, step: int, metrics: Optional[Dict[str, float]] = None, force: bool = False) -> bool:
        """Trainer state + the driver's (step, sampler position, the rollout mode's state, the step's metrics so
        far: written on resume if the line itself was lost). Returns whether it saved."""
        cfg = self.cfg
        interval = cfg.checkpoint.interval
        if not (force or (interval and step % interval == 0) or step == cfg.last_step):
            return False
        from megatron_rl.training.checkpoint import CheckpointConfig

        c = cfg.checkpoint
        ckpt = CheckpointConfig(root=cfg.checkpoint_root, keep_last=c.keep_last, save_optimizer=c.save_optimizer,
                                optimizer_format=c.optimizer_format)
        # Megatron loads the common state with torch.load(weights_only=True): plain types only (the rollout
        # modes pickle their records into bytes)
        row = {k: float(v) for k, v in (metrics or {}).items() if isinstance(v, (int, float))}
        row.update({f"time/{k}": v for k, v in self.timer.seconds.items()})
        state = {"version": STATE_VERSION, "step": step, "sampler": self.sampler.state_dict(),
                 "rollouts": self.batches.state_dict(), "row": row}
        with self._trainer_state_loaded(), self.timer.phase("checkpoint"):
            path = self.trainers.save_checkpoint(ckpt, {"driver": state}, step)
            if step == cfg.steps and c.save_hf:
                self.trainers.save_hf(os.path.join(cfg.output_dir, "hf_final"))
        logger.info("step %d: checkpoint %s", step, path)
        return True

    # ---- logging -------------------------------------------------------------------------------------------
    def log(self, step: int, metrics: Dict[str, float], batch: Optional[RolloutBatch] = None) -> Dict[str, float]:
        """Write the step's line (metrics.jsonl, tensorboard, wandb) with timings and tokens/s."""
        from megatron_rl.metrics import throughput

        metrics = {**metrics, **self.timer.finish_step()}
        metrics.update(throughput(metrics, metrics))
        if self.recovery is not None:
            metrics.update(self.recovery.metrics())
        # engines' busy time measured by the driver (generation can overlap any phase)
        metrics.update(perf.step_metrics(metrics, self.flops, self.devices, self.peak_flops,
                                         engine_busy_s=self.rollouts.meter.since_last()))
        text = {}
        if batch is not None and batch.groups and self.cfg.logging.print_samples:
            g = batch.groups[0]
            text["samples"] = "\n".join(f"{g.record.prompt_text!r} -> {t!r} (reward {r:g})"
                                        for t, r in list(zip(g.texts, g.rewards))[: self.cfg.logging.print_samples])
        self.metrics.log(step, metrics, text)
        logger.info(_console_line(step, self.cfg.steps, metrics, self.is_warmup(step)))
        for line in text.get("samples", "").splitlines():
            logger.info("  sample: %s", line)
        return metrics


def _console_line(step: int, steps: int, m: Dict[str, float], warmup: bool) -> str:
    parts = [f"step {step}/{steps}" + (" [warm-up]" if warmup and step else "")]
    for key, label, fmt in (("rollout/reward_mean", "reward", ".3f"), ("batch/reward_mean", "batch", ".3f"),
                            ("eval/reward_mean", "eval", ".3f"), ("train/loss", "loss", ".4f"),
                            ("logprobs/ref_kl_forward", "ref_kl_fwd", ".3f"), ("logprobs/ref_kl_reverse", "ref_kl", ".3f"), ("logprobs/mismatch_k3", "mismatch_k3", ".1e"),
                            ("rollout/groups_kept", "groups", ".0f"), ("time/step", "s", ".1f")):
        if key in m:
            parts.append(f"{label} {m[key]:{fmt}}")
    phases = [f"{k[5:]} {v:.1f}" for k, v in m.items() if k.startswith("time/") and k != "time/step" and v >= 0.05]
    return " | ".join(parts) + (f" ({', '.join(phases)})" if phases else "")
