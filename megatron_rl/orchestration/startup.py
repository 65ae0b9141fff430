"""A run's resources, started in order: the data (tokenizer, prompts, sampler, reward workers), then the cluster
(Ray, placement groups, trainer ranks and engine servers started concurrently, the driver's
:class:`RemoteEngine` over the servers' URLs, colocation). Each start registers its tear-down with ``closers``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from transformers import AutoTokenizer

from megatron_rl import config_io
from megatron_rl.config import RunConfig
from megatron_rl.data.prompts import PromptDataset
from megatron_rl.data.rewards.runner import RewardRunner
from megatron_rl.data.sampler import PromptSampler
from megatron_rl.metrics import PhaseTimer
from megatron_rl.models.build import load_arch
from megatron_rl.orchestration import placement, ray_waits
from megatron_rl.orchestration.colocation import Colocation
from megatron_rl.orchestration.engine_worker import EngineSpec
from megatron_rl.orchestration.progress import maybe_board
from megatron_rl.orchestration.trainer_group import TrainerGroup
from megatron_rl.orchestration.trainer_worker import TrainerSpec
from megatron_rl.rollout.client.balancer import RemoteEngine
from megatron_rl.rollout.client.http_client import SGLangClient
from megatron_rl.routing import RoutingLayout
from megatron_rl.routing.align import expert_layout
from megatron_rl.training.micro_batch import packed_lengths
from megatron_rl.training.token_budget import WorkModel

logger = logging.getLogger(__name__)
Closers = List[Callable[[], None]]


@dataclass
class Data:
    tokenizer: Any
    dataset: PromptDataset
    eval_datasets: Dict[str, PromptDataset]
    rewards: RewardRunner
    sampler: PromptSampler


def start_data(cfg: RunConfig, closers: Closers) -> Data:
    try:  # what --dry-run could not know without tokenising: an empty prompt, every prompt too long...
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
        dataset = PromptDataset(cfg.data, tokenizer)
        eval_datasets = {name: PromptDataset(d, tokenizer) for name, d in cfg.eval.named_datasets.items()}
        reward_cfg = cfg.reward
        if not cfg.logging.progress:  # the runner's own bar follows the run's switch
            reward_cfg = dataclasses.replace(reward_cfg, progress_min_batch=2**62)
        rewards = RewardRunner(reward_cfg)
    except ValueError as e:
        raise config_io.ConfigError(str(e)) from None
    closers.append(rewards.close)
    logger.info("data: %s", dataset.stats)
    return Data(tokenizer, dataset, eval_datasets, rewards, PromptSampler.from_config(dataset))


@dataclass
class Cluster:
    local_ray: Optional[placement.LocalRay]  # the local Ray this run started
    placement: placement.Placement
    trainers: Optional[TrainerGroup]  # set by connect()
    engine: Optional[RemoteEngine]
    routing: Optional[RoutingLayout]  # routing replay: the trainer's MoE layout, to decode and check engine routes
    colocation: Optional[Colocation]  # colocated placement with engines launched here

    def shutdown(self, failed: bool) -> None:
        """The workers are asked to stop (after a failure only briefly: a rank may hang in a collective), then
        killed; a local Ray is shut down and its parent-death guard released."""
        try:
            self.placement.shutdown(timeout_s=3.0 if failed else 30.0)
        finally:
            if self.local_ray is not None:
                self.local_ray.shutdown()


def worker_specs(cfg: RunConfig) -> Tuple[TrainerSpec, Optional[EngineSpec]]:
    r = cfg.rollout
    # a sample-based KL needs log pi_ref of the sampled tokens: the trainer loads the reference for it
    ref_lp = (cfg.train.reference_model or cfg.model) if cfg.train.objective.needs_sample_kl_reference else None
    # with routing replay, the post-sync probe replays each engine's routing of the probe too
    weight_sync = dataclasses.replace(r.weight_sync, replay_routing=cfg.train.routing_replay)
    if r.engine == "embedded" and weight_sync.engine_dtype is None:  # send what the engine holds
        weight_sync = dataclasses.replace(weight_sync, engine_dtype=r.embedded_dtype)
    trainer = TrainerSpec(model=cfg.model, train=cfg.train, optim=cfg.optim, layout=cfg.parallel.layout,
                          weight_sync=weight_sync, seed=cfg.model.seed, threads=cfg.cluster.threads_per_worker,
                          backend=cfg.cluster.backend, ref_logprobs_model=ref_lp)
    engine = None
    if r.engine != "remote":
        engine = EngineSpec(kind=r.engine, model_path=cfg.model.hf_path, deterministic=r.deterministic_inference,
                            seed=cfg.seed, host=r.host, threads=cfg.cluster.threads_per_worker,
                            routed_experts=cfg.train.routing_replay, dtype=r.embedded_dtype, log_dir=cfg.output_dir,
                            sglang=r.sglang, profile_dir=os.path.dirname(cfg.profile.step_dir(cfg.output_dir, 1)))
    return trainer, engine


def place_cluster(cfg: RunConfig) -> Cluster:
    """Ray and the placement groups (trainer and engine actors, not started yet); connect with :func:`connect`."""
    trainer_spec, engine_spec = worker_specs(cfg)
    r = cfg.rollout
    local_ray = placement.init_ray(cfg.cluster, placement.required_cpus(cfg.cluster, cfg.parallel.world_size, r))
    try:
        placed = placement.place(cfg.cluster, r, cfg.parallel.world_size, trainer_spec, engine_spec)
    except BaseException:
        if local_ray is not None:
            local_ray.shutdown()
        raise
    return Cluster(local_ray, placed, None, None, None, None)


def connect(cfg: RunConfig, cluster: Cluster, timer: PhaseTimer, closers: Closers) -> None:
    """Engines started while the trainer ranks set up; the driver's clients over the engines' URLs."""
    r = cfg.rollout
    url_refs = _start_engines(cfg, cluster.placement)  # engines load while trainers set up
    board = maybe_board(cfg.logging.progress)
    if board is not None:
        closers.append(board.close)
    cluster.trainers = TrainerGroup(cluster.placement.trainers, progress=board, work=_dp_work(cfg))
    cluster.trainers.setup()
    cluster.trainers.start_heartbeat(cfg.cluster.stall_warn_s, cfg.cluster.stall_fail_s)
    closers.append(cluster.trainers.stop_heartbeat)
    # each launch has its own health timeout; the margin covers the interpreter start around it
    launch_s = max(EngineSpec.launch_timeout_s, r.sglang.health_timeout_s) + ray_waits.SHORT_S
    urls = ray_waits.get(url_refs, launch_s, "starting the rollout engines") if url_refs else list(r.urls)
    logger.info("rollout servers: %s", urls)
    layout = None
    if cfg.train.routing_replay:
        arch = load_arch(cfg.model.hf_path)
        cluster.routing, layout = RoutingLayout.from_arch(arch), expert_layout(arch)
    clients = [SGLangClient(u, timeout_s=r.request_timeout_s, expert_layout=layout, logprob_mode=r.logprob_mode,
                            max_in_flight=r.max_samples_in_flight, control_timeout_s=r.control_timeout_s) for u in urls]
    cluster.engine = RemoteEngine(clients, policy=r.balancer, max_concurrency=r.max_concurrency)
    closers.append(cluster.engine.shutdown)
    cluster.trainers.connect_engines(urls, r.transport, r.balancer, r.request_timeout_s,
                                     pause_mode="retract" if r.partial else None,
                                     control_timeout_s=r.control_timeout_s)
    if r.placement == "colocated" and cluster.placement.engines:
        offload = r.offload_trainer if r.offload_trainer is not None else cfg.cluster.gpus_per_trainer > 0
        cluster.colocation = Colocation(cluster.engine, cluster.trainers, timer, offload_trainer=offload,
                                        check=r.weight_sync.check)


def _start_engines(cfg: RunConfig, placed: placement.Placement) -> list:
    """Start every engine server (Ray refs of their URLs); colocated SGLang on its trainer ranks' GPUs."""
    r, engines = cfg.rollout, placed.engines
    if not (r.engine == "sglang" and r.placement == "colocated"):
        return [e.start.remote() for e in engines]
    ids = ray_waits.get([t.device_ids.remote() for t in placed.trainers], ray_waits.SHORT_S, "trainer device ids")
    devices = placement.colocated_devices(ids, placement.engine_tp(r), len(engines))
    return [e.start.remote(d) for e, d in zip(engines, devices)]


def _dp_work(cfg: RunConfig):
    """With a token budget: the trainer's estimate of a sequence's work (lengths as packed under CP), by
    which the driver balances its data-parallel split; None: equal contiguous shards."""
    if not cfg.train.token_budget:
        return None
    model, cp = WorkModel.from_arch(load_arch(cfg.model.hf_path)), cfg.parallel.cp
    return lambda lengths: model(packed_lengths(torch.tensor(lengths), cp).tolist())
