"""Ray start-up and placement: where trainer ranks and rollout engines run.

* ``colocated``: one placement group of ``world_size`` bundles ``{CPU: cpus_per_trainer, GPU:
  gpus_per_trainer}``; trainer rank ``i`` takes half of bundle ``i`` and engine ``i`` (if any) the other
  half — on GPUs that is Ray's fractional-GPU sharing, both processes see the same device. An SGLang
  server of TP size ``k`` is engine ``e`` on bundle ``e * k`` and runs on the GPUs of trainer ranks
  ``e * k .. e * k + k - 1`` (:func:`colocated_devices`; one node). The driver releases the engines'
  memory while the trainer runs and resumes it around the weight sync (``run.py``).
* ``disaggregated``: the trainers' placement group as above (whole bundles) plus one for the engines,
  ``num_engines`` bundles ``{CPU: cpus_per_engine, GPU: gpus_per_engine}`` (an SGLang server with
  ``tp_size`` GPUs takes one bundle of that many GPUs).

Both groups use the ``PACK`` strategy (a trainer group on as few nodes as possible, so tensor and
pipeline parallel traffic stays local). A local Ray is started with ``address="local"`` — never
attaching by accident to another cluster on the machine — with enough logical CPUs for every worker,
with every server on the loopback interface (Ray's local-only mode: the node address is 127.0.0.1, so
gcs, raylet, agents and every worker bind there; gloo's sockets too, :func:`worker_env`; nothing listens on
the network), and with a parent-death guard (:mod:`.ray_guard`) that removes its processes if the driver is
killed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import ray
from ray._private import ray_constants
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megatron_rl.config import ClusterConfig, RolloutConfig
from megatron_rl.orchestration.engine_worker import EngineSpec, EngineWorker
from megatron_rl.orchestration.ray_guard import Guard
from megatron_rl.orchestration.signals import keep_handlers
from megatron_rl.orchestration.trainer_worker import TrainerSpec, TrainerWorker

logger = logging.getLogger(__name__)


def _bundle(cpus: float, gpus: float) -> Dict[str, float]:
    out = {"CPU": cpus}
    if gpus > 0:  # Ray refuses zero-valued bundle entries
        out["GPU"] = gpus
    return out


def _needs_engine_workers(rollout: RolloutConfig) -> bool:
    return rollout.engine in ("embedded", "sglang")


def required_cpus(cluster: ClusterConfig, world_size: int, rollout: RolloutConfig) -> float:
    engines = rollout.num_engines if _needs_engine_workers(rollout) and rollout.placement == "disaggregated" else 0
    return world_size * cluster.cpus_per_trainer + engines * cluster.cpus_per_engine


class LocalRay:
    """The local Ray a run started: :meth:`shutdown` stops it and releases the guard."""

    def __init__(self, guard: Guard):
        self.guard = guard

    def shutdown(self) -> None:
        try:
            ray.shutdown()
        finally:
            self.guard.release()


def init_ray(cluster: ClusterConfig, needed_cpus: float) -> Optional[LocalRay]:
    """Connect to (``cluster.address``) or start a local Ray; returns a handle when we started it."""
    if ray.is_initialized():
        return None
    env = worker_env(cluster)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if cluster.address:
        with keep_handlers():
            ray.init(address=cluster.address, runtime_env={"env_vars": env}, logging_level="warning")
        return None
    num_cpus = cluster.num_cpus or max(float(os.cpu_count() or 1), needed_cpus)
    cpu_only = cluster.gpus_per_trainer == 0 and cluster.gpus_per_engine == 0
    # batches are small next to a CPU machine's memory; Ray's default (30 % of RAM) would pin GBs of shm
    store = 512 * 1024**2 if cpu_only else None
    guard = Guard()
    try:
        with _loopback_only(), keep_handlers():
            ray.init(address="local", num_cpus=int(-(-num_cpus // 1)), include_dashboard=False,
                     logging_level="warning", runtime_env={"env_vars": env}, object_store_memory=store)
    except BaseException:
        ray.shutdown()  # a start cut short (a signal) may have left part of Ray running
        guard.release()
        raise
    guard.watch(ray._private.worker._global_node.get_session_dir_path())  # every Ray process logs in there
    return LocalRay(guard)


def worker_env(cluster: ClusterConfig) -> Dict[str, str]:
    """The environment of the run's Ray workers (trainer ranks, engines and the servers they start). A local run
    binds gloo to the loopback interface (``GLOO_SOCKET_IFNAME=lo``, unless the user chose one): gloo listens on
    the address the hostname resolves to, often the machine's network address."""
    env = {"OMP_NUM_THREADS": str(cluster.threads_per_worker), "TOKENIZERS_PARALLELISM": "false",
           "RAY_USAGE_STATS_ENABLED": "0"}
    if not cluster.address and "GLOO_SOCKET_IFNAME" not in os.environ and hasattr(socket, "if_nameindex") \
            and "lo" in (name for _, name in socket.if_nameindex()):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


@contextlib.contextmanager
def _loopback_only():
    """Ray's local-only mode (its default on macOS and Windows): the node address is 127.0.0.1 instead of the
    machine's network address, and Ray's servers bind to it. ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is read
    when ``ray`` is imported (by Ray's own processes, which inherit it); the driver may have imported ray
    already, so its constant is set for the ``ray.init`` call too."""
    key, before = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    constant = ray_constants.ENABLE_RAY_CLUSTER
    os.environ[key], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = constant
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


@dataclass
class Placement:
    """The actors and placement groups of a run; :meth:`shutdown` removes them."""

    trainers: List[Any]
    engines: List[Any]
    groups: List[Any] = field(default_factory=list)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Ask every engine and trainer to stop (all at once, ``timeout_s`` in all: after a failure a rank may
        be stuck in a collective and never answer), then kill the actors and remove the groups."""
        refs = {}
        for i, e in enumerate(self.engines):
            refs[e.stop.remote()] = f"engine {i}"
        for t in self.trainers:
            refs[t.shutdown.remote()] = None
        _, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        for ref in refs:
            if refs[ref] is None:
                continue
            try:
                if ref in pending:
                    raise TimeoutError(f"no answer within {timeout_s:g} s")
                ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - best effort while tearing down
                logger.warning("%s did not stop cleanly: %s", refs[ref], exc)
        for actor in self.engines + self.trainers:
            ray.kill(actor)
        for pg in self.groups:
            remove_placement_group(pg)


def _ready(pg, what: str, timeout_s: float = 600.0) -> None:
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"Ray could not place the {what} ({pg.bundle_specs}) within {timeout_s:.0f} s: the "
                           f"cluster offers {ray.available_resources()}; lower cluster.cpus_per_*/gpus_per_* or add "
                           "nodes") from None


def place(cluster: ClusterConfig, rollout: RolloutConfig, world_size: int, trainer_spec: TrainerSpec,
          engine_spec: Optional[EngineSpec]) -> Placement:
    """Create the placement groups and the (not yet set-up) trainer and engine actors."""
    colocated = rollout.placement == "colocated"
    share = 0.5 if colocated and engine_spec is not None else 1.0
    c_t, g_t = cluster.cpus_per_trainer, cluster.gpus_per_trainer
    trainer_pg = placement_group([_bundle(c_t, g_t)] * world_size, strategy="PACK", name="megatron_rl_trainers")
    _ready(trainer_pg, "trainer bundles")
    groups = [trainer_pg]
    trainer_cls = ray.remote(TrainerWorker)
    trainers = [
        trainer_cls.options(num_cpus=c_t * share, num_gpus=g_t * share,
                            scheduling_strategy=PlacementGroupSchedulingStrategy(trainer_pg, placement_group_bundle_index=i)
                            ).remote(i, world_size, trainer_spec)
        for i in range(world_size)
    ]
    engines: List[Any] = []
    if engine_spec is not None:
        engine_cls = ray.remote(EngineWorker)
        if colocated:
            pg, cpus, gpus = trainer_pg, c_t * (1 - share), g_t * (1 - share)
        else:
            cpus, gpus = cluster.cpus_per_engine, cluster.gpus_per_engine
            pg = placement_group([_bundle(cpus, gpus)] * rollout.num_engines, strategy="PACK",
                                 name="megatron_rl_engines")
            _ready(pg, "rollout engine bundles")
            groups.append(pg)
        stride = engine_tp(rollout) if colocated else 1
        for i in range(rollout.num_engines):
            spec = EngineSpec(**{**engine_spec.__dict__, "index": i})
            engines.append(engine_cls.options(
                num_cpus=cpus, num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=i * stride)).remote(spec))
    return Placement(trainers=trainers, engines=engines, groups=groups)


def engine_tp(rollout: RolloutConfig) -> int:
    """GPUs (trainer ranks, when colocated) per engine."""
    return rollout.sglang.tp_size if rollout.engine == "sglang" else 1


def colocated_devices(device_ids: List[Tuple[str, List[str]]], tp: int, num_engines: int) -> List[str]:
    """``CUDA_VISIBLE_DEVICES`` of each colocated engine: the GPUs of trainer ranks ``e * tp .. e * tp + tp - 1``
    (``device_ids[r]``: rank ``r``'s node and GPU ids, ``TrainerWorker.device_ids``), in rank order, so SGLang
    TP rank ``i`` shares trainer rank ``e * tp + i``'s GPU."""
    out = []
    for e in range(num_engines):
        ranks = list(range(e * tp, (e + 1) * tp))
        if len({device_ids[r][0] for r in ranks}) > 1:
            raise RuntimeError(f"colocated engine {e} spans trainer ranks {ranks} on several nodes: a server's TP "
                               "ranks must share a node; make rollout.sglang.tp_size divide the GPUs per node")
        out.append(",".join(g for r in ranks for g in device_ids[r][1]))
    return out
