"""A run's resources and its phases, one method each; the loop that calls them is ``driver.py``.

Start-up (:meth:`Run.__enter__`): output directory and resolved ``config.yaml``; tokenizer, prompt
data and sampler; reward workers; Ray, placement groups, trainer ranks and engine servers (started
concurrently); the driver's :class:`RemoteEngine` over the servers' URLs; then either resume (trainer
checkpoint + the driver's state: step, sampler position, a pending off-policy rollout) followed by a
weight sync, or the step-0 check that engines and trainer agree on the probe's log-probs.

The driver process owns everything that is not a tensor computation over the model: data, rewards,
advantages, logging. Trainers and engines are only reached through Ray calls and HTTP.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import pickle
import shutil
from typing import Any, Dict, Optional, Tuple

from megatron_rl import config_io, perf
from megatron_rl.config import RunConfig, dump_yaml
from megatron_rl.metrics import MetricsLogger, PhaseTimer
from megatron_rl.objectives import ObjectiveConfig
from megatron_rl.orchestration import batching
from megatron_rl.orchestration.rollout import RolloutBatch, RolloutPhase

logger = logging.getLogger(__name__)
STATE_VERSION = 1


class Run:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.timer = PhaseTimer()
        self.start_step = 0
        self.pending: Optional[RolloutBatch] = None  # an off-policy rollout restored from a checkpoint
        self.resumed = False
        self.placement = None
        self._released = False
        self._owns_ray = False
        self._closers = []
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="next-rollout")
        self._profiling: Optional[int] = None  # the step a profiler capture runs for

    # ---- start-up / tear-down ---------------------------------------------------------------------------
    def __enter__(self) -> "Run":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        cfg = self.cfg
        self._prepare_output_dir()
        self._start_data()
        self._start_workers()
        self._start_perf()
        self._restore_or_check()
        self.metrics = MetricsLogger(cfg.logging, resume_step=self.start_step if self.resumed else None,
                                     run_name=os.path.basename(os.path.abspath(cfg.output_dir)),
                                     config_dict=config_io.to_dict(cfg))
        self._closers.append(self.metrics.close)
        self.startup_seconds = self.timer.finish_step()["time/step"]  # reported once, not in step 1's time

    def _prepare_output_dir(self) -> None:
        cfg = self.cfg
        if cfg.overwrite and not cfg.resume:
            for path in (cfg.checkpoint_root, os.path.join(cfg.output_dir, "tensorboard"),
                         os.path.join(cfg.output_dir, "metrics.jsonl")):
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
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
        self.dataset = PromptDataset(cfg.data, self.tokenizer)
        self.sampler = PromptSampler.from_config(self.dataset)
        self.eval_datasets = {name: PromptDataset(d, self.tokenizer) for name, d in cfg.eval.named_datasets.items()}
        reward_cfg = cfg.reward
        if not cfg.logging.progress:  # the runner's own bar follows the run's switch
            reward_cfg = dataclasses.replace(reward_cfg, progress_min_batch=2**62)
        self.rewards = RewardRunner(reward_cfg)
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
        from megatron_rl.rollout.balancer import RemoteEngine
        from megatron_rl.rollout.http_client import SGLangClient

        cfg, r = self.cfg, self.cfg.rollout
        trainer_spec, engine_spec = self._specs()
        self._owns_ray = placement.init_ray(cfg.cluster, placement.required_cpus(cfg.cluster, cfg.parallel.world_size, r))
        self.placement = placement.place(cfg.cluster, r, cfg.parallel.world_size, trainer_spec, engine_spec)
        url_refs = [e.start.remote() for e in self.placement.engines]  # engines load while trainers set up
        board = maybe_board(cfg.logging.progress)
        if board is not None:
            self._closers.append(board.close)
        self.trainers = TrainerGroup(self.placement.trainers, progress=board)
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
        clients = [SGLangClient(u, timeout_s=r.request_timeout_s, expert_layout=layout, logprob_mode=r.logprob_mode)
                   for u in urls]
        self.engine = RemoteEngine(clients, policy=r.balancer, max_concurrency=r.max_concurrency)
        self._closers.append(self.engine.shutdown)
        self.trainers.connect_engines(urls, r.transport, r.balancer, r.request_timeout_s)
        unit = self.trainers.dp * cfg.train.micro_batch_size
        self.rollouts = RolloutPhase(r, self.engine, self.tokenizer, self.sampler, self.rewards, seed=cfg.seed,
                                     batch_unit=unit, progress_bars=cfg.logging.progress,
                                     routed_experts=cfg.train.routing_replay)
        self._closers.append(self.rollouts.close)
        from megatron_rl.orchestration.evaluate import Evaluator

        self.evaluator = (Evaluator(cfg.eval, self.eval_datasets, self.rollouts, cfg.seed)
                          if self.eval_datasets else None)

    def _start_perf(self) -> None:
        """What MFU needs: the model's FLOPs per token, the devices, the device peak (trainer rank 0's)."""
        from megatron_rl.models.build import load_arch

        cfg = self.cfg
        self.flops = perf.ModelFlops.from_arch(load_arch(cfg.model.hf_path))
        self.devices = perf.run_devices(cfg)
        info = self.trainers.infos[0]
        self.peak_flops = info.get("peak_flops")
        if self.peak_flops:
            logger.info("MFU: %.2f TFLOP/s peak per device (%s, %s); %d trainer + %d engine device(s)%s",
                        self.peak_flops / 1e12, info.get("device"), info.get("source"), self.devices.trainer,
                        self.devices.engine, " (colocated)" if self.devices.colocated else "")

    def _restore_or_check(self) -> None:
        from megatron_rl.training.checkpoint import latest_checkpoint

        cfg = self.cfg
        path = latest_checkpoint(cfg.checkpoint_root) if cfg.resume else None
        if cfg.resume and path is None:
            logger.warning("resume=true but %s holds no checkpoint: starting a new run", cfg.checkpoint_root)
        if path is not None:
            loaded = self.trainers.load_checkpoint(cfg.checkpoint_root)
            state = loaded.extra["driver"]
            if state.get("version") != STATE_VERSION:
                raise ValueError(f"{path}: driver state version {state.get('version')} != {STATE_VERSION}")
            self.sampler.load_state_dict(state["sampler"])
            pending = state["pending"]
            self.start_step, self.resumed = state["step"], True
            self.pending = None if pending is None else pickle.loads(pending)
            # engines started from model.hf_path: give them the checkpoint's weights
            stats = self.trainers.sync_weights(version=self.start_step)
            logger.info("resumed from %s at step %d (optimizer step %d); engines synced (probe max |dlogp| %.2e)",
                        path, self.start_step, loaded.step, stats.check.max_abs_diff if stats.check else float("nan"))
        elif cfg.rollout.weight_sync.check:
            check = self.trainers.check_weights()  # step-0 numerics: engines and trainer on the same weights
            logger.info("step-0 check: engine vs trainer probe log-probs max |diff| %.2e over %d tokens",
                        check.max_abs_diff, check.length)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)  # an interrupted rollout is abandoned
        for close in reversed(self._closers):
            try:
                close()
            except Exception as e:  # noqa: BLE001 - keep tearing down
                logger.warning("while closing: %s", e)
        self._closers = []
        if self.placement is not None:
            self.placement.shutdown()
            self.placement = None
        if self._owns_ray:
            import ray

            ray.shutdown()
            self._owns_ray = False

    # ---- phases -------------------------------------------------------------------------------------------
    def is_warmup(self, step: int) -> bool:
        return step <= self.cfg.warmup.steps

    def rollout(self, step: int) -> RolloutBatch:
        """Rollout -> rewards -> dynamic-sampling filter (no filter during the imitation warm-up)."""
        return self.rollouts.collect(step, filter_groups=not self.is_warmup(step))

    def rollout_async(self, step: int) -> Optional[concurrent.futures.Future]:
        """One-step off-policy: start ``step``'s rollout now, on the weights the engines hold. Also past a
        ``stop_after_steps`` stop: the checkpoint then carries it, and the resumed run trains on exactly the
        samples the uninterrupted run would have."""
        if not self.cfg.rollout.off_policy or step > self.cfg.steps:
            return None
        return self._executor.submit(self.rollout, step)

    def wait(self, future: Optional[concurrent.futures.Future]) -> Optional[RolloutBatch]:
        if future is None:
            return None
        with self.timer.phase("rollout_wait"):
            return future.result()

    def release_engines(self) -> None:
        """Colocated: the engines free their memory for the trainer (resumed before the weight sync)."""
        if self._colocated:
            with self.timer.phase("engine_memory"):
                self.engine.release_memory()
            self._released = True

    def resume_engines(self) -> None:
        if self._released:
            with self.timer.phase("engine_memory"):
                self.engine.resume_memory()
            self._released = False

    @property
    def _colocated(self) -> bool:
        return self.cfg.rollout.placement == "colocated" and bool(self.placement.engines)

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
            result = self.trainers.train_step(tb, self.cfg.objective_at(step))
        out = {"train/loss": result.loss, "train/grad_norm": result.grad_norm, "train/lr": result.lr,
               "train/skipped": float(result.skipped), "train/optimizer_step": float(result.step),
               "train/tokens": float(tb.seq_lengths.sum()), "train/sequences": float(tb.batch_size),
               "train/warmup": float(self.is_warmup(step))}
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
        with self.timer.phase("weight_sync"):
            stats = self.trainers.sync_weights(version=step)
        out = {"sync/seconds": stats.seconds, "sync/mib": stats.bytes / 2**20, "sync/buckets": float(stats.buckets)}
        if stats.check is not None:
            out["sync/probe_max_abs_diff"] = stats.check.max_abs_diff
        return out

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

    def checkpoint(self, step: int, pending: Optional[RolloutBatch]) -> None:
        """Trainer state + the driver's (step, sampler position, the pending off-policy rollout)."""
        cfg = self.cfg
        interval = cfg.checkpoint.interval
        if not ((interval and step % interval == 0) or step == cfg.last_step):
            return
        from megatron_rl.training.checkpoint import CheckpointConfig

        c = cfg.checkpoint
        ckpt = CheckpointConfig(root=cfg.checkpoint_root, keep_last=c.keep_last, save_optimizer=c.save_optimizer,
                                optimizer_format=c.optimizer_format)
        # Megatron loads the common state with torch.load(weights_only=True): plain types only, so the pending
        # off-policy rollout (our dataclasses) travels pickled, as bytes; it is read back only by _restore
        state = {"version": STATE_VERSION, "step": step, "sampler": self.sampler.state_dict(),
                 "pending": None if pending is None else pickle.dumps(pending)}
        with self.timer.phase("checkpoint"):
            path = self.trainers.save_checkpoint(ckpt, {"driver": state}, step)
            if step == cfg.steps and c.save_hf:
                self.trainers.save_hf(os.path.join(cfg.output_dir, "hf_final"))
        logger.info("step %d: checkpoint %s", step, path)

    # ---- logging -------------------------------------------------------------------------------------------
    def log(self, step: int, metrics: Dict[str, float], batch: Optional[RolloutBatch] = None) -> Dict[str, float]:
        """Write the step's line (metrics.jsonl, tensorboard, wandb) with timings and tokens/s."""
        from megatron_rl.metrics import throughput

        metrics = {**metrics, **self.timer.finish_step()}
        metrics.update(throughput(metrics, metrics))
        metrics.update(perf.step_metrics(metrics, self.flops, self.devices, self.peak_flops))
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
