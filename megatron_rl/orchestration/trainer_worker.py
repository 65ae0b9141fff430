"""One trainer rank as a Ray actor: a ``PolicyTrainer`` plus weight sync and checkpoints.

The driver creates ``world_size`` of these (one per GPU, or per CPU slot), asks rank 0 for a rendezvous
address, then calls :meth:`TrainerWorker.setup` on all of them at once: ``torch.distributed``
(gloo on CPU, nccl on GPU) over ``tcp://MASTER_ADDR:MASTER_PORT``, Megatron's parallel state, the
model, optimizer and (optionally) a frozen reference model. Every other method is *collective*: the
driver calls it on all ranks concurrently (:class:`~megatron_rl.orchestration.trainer_group.TrainerGroup`)
with each rank's data-parallel shard of the batch.

Weight sync: rank 0 holds a :class:`~megatron_rl.rollout.client.balancer.RemoteEngine` over the engine
servers and drives :class:`~megatron_rl.weights.sync.WeightSync`; the other ranks join its
gathers (with the ``ipc`` transport of colocated engines every rank beside an engine sends its own copy).
Results that are identical on every rank come back from rank 0 only (less Ray traffic).

Colocated placement: :meth:`offload` / :meth:`reload` move the optimizer state and gradient buffers to
host memory while the engines hold the GPU (``training/offload.py``); both return the resident memory.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import ray
import torch
import torch.distributed as dist

from megatron_rl import parallel
from megatron_rl.config.rollout import WeightSyncConfig
from megatron_rl.config.train import OptimConfig, TrainConfig
from megatron_rl.models.config import ModelConfig, torch_dtype
from megatron_rl.models.weights import save_hf_checkpoint
from megatron_rl.objectives import ObjectiveConfig
from megatron_rl.orchestration.failures import identity
from megatron_rl.orchestration.heartbeat import Beater
from megatron_rl.orchestration.trainer_weights import TrainerWeights
from megatron_rl.parallel import ParallelLayout
from megatron_rl.profiling import Capture
from megatron_rl.training import PolicyTrainer
from megatron_rl.training.checkpoint import load_checkpoint, save_checkpoint
from megatron_rl.training.offload import TrainerOffload, memory_snapshot, reset_peak


@dataclass
class TrainerSpec:
    """What every rank builds (the trainer's sections of the run config, nothing else)."""

    model: ModelConfig
    train: TrainConfig
    optim: OptimConfig
    layout: ParallelLayout
    weight_sync: WeightSyncConfig
    seed: int = 0
    threads: int = 1
    backend: Optional[str] = None
    ref_logprobs_model: Optional[ModelConfig] = None  # a forward-only reference for sample-based KL penalties


def _quiet_warnings() -> None:
    # Known, harmless noise of megatron-core on CPU (no TE / apex) and of torch.distributed.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")


class TrainerWorker(TrainerWeights):
    def __init__(self, rank: int, world_size: int, spec: TrainerSpec):
        _quiet_warnings()

        torch.set_num_threads(spec.threads)
        self.rank, self.world_size, self.spec = rank, world_size, spec
        self.trainer = None
        self.ref = None
        self.engine = None
        self.sync = None
        self._transport = None
        self._regroup = False  # distributed transport: rebuild the weight group before the next sync (every rank)
        self._store = None  # rank 0: the rendezvous store it hosts
        self.reporter = None  # progress: reports to the driver's bars (orchestration.progress)
        self.offloader = None  # colocated: optimizer state + gradient buffers to host memory and back
        self.capture = None  # a torch-profiler session (profile.steps)
        self.beater = None  # trainer heartbeats (start_heartbeat)

    # ---- set-up ------------------------------------------------------------------------------------
    def rendezvous_address(self) -> Tuple[str, int]:
        """(this node's IP, the port of the rendezvous store it now hosts); called on rank 0 only."""
        ip = ray.util.get_node_ip_address()
        self._store = parallel.rendezvous_store(ip, 0, self.world_size, is_master=True)
        return ip, self._store.port

    def setup(self, master_addr: str, master_port: int) -> Dict[str, int]:
        spec = self.spec
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK="0")
        store = self._store or parallel.rendezvous_store(master_addr, master_port, self.world_size,
                                                                          is_master=False)
        parallel.init_process_group(self.rank, self.world_size, backend=spec.backend, store=store)
        groups = parallel.init_megatron_parallel(spec.layout, seed=spec.seed)
        self.groups = groups
        self.trainer = PolicyTrainer(spec.model, spec.train, groups, spec.optim)
        if spec.ref_logprobs_model is not None:
            plain = dataclasses.replace(spec.train, reference_model=None, objective=ObjectiveConfig())
            self.ref = PolicyTrainer(spec.ref_logprobs_model, plain, groups)

        info = dict(rank=self.rank, dp_rank=groups.dp_rank, tp_rank=groups.tp_rank, pp_rank=groups.pp_rank,
                    cp_rank=groups.cp_rank, dp=dist.get_world_size(groups.dp),
                    **identity())  # pid, log: to name the rank if it dies
        if self.rank == 0:  # the device's peak FLOP/s, for MFU (a table, or a matmul measured once here)
            from megatron_rl.perf import device_peak_flops

            info.update(device_peak_flops(torch_dtype(spec.model)))
        return info

    def start_heartbeat(self, board, interval_s: float) -> None:
        """Beat to the driver's board every ``interval_s`` from a thread of this rank (``heartbeat.py``)."""
        self.beater = Beater(board, self.rank, interval_s).start()

    def set_progress(self, reporter) -> None:
        """Bars for micro-batches (from the first replica's first TP rank: every replica runs as many)
        and weight sync (from its sender, rank 0)."""
        self.reporter = reporter
        if self.groups.tp_rank == 0 and self.groups.dp_rank == 0 and self.groups.cp_rank == 0:
            self.trainer.progress = reporter
        if self.sync is not None and self.rank == 0:
            self.sync.progress = reporter

    def _reports(self) -> bool:
        """One rank per data-parallel replica returns per-sequence results (every stage and CP rank has them)."""
        return self.groups.tp_rank == 0 and self.groups.pp_rank == 0 and self.groups.cp_rank == 0

    # ---- compute -------------------------------------------------------------------------------------
    def forward(self, batch, objective: Optional[ObjectiveConfig] = None):
        result = self.trainer.forward(batch, objective)
        return (self.groups.dp_rank, result) if self._reports() else None

    def ref_logprobs(self, batch):
        result = self.ref.forward(batch)
        return (self.groups.dp_rank, result.logprobs) if self._reports() else None

    def train_step(self, batch, objective: Optional[ObjectiveConfig] = None):
        self._require_loaded("train_step")
        result = self.trainer.train_step(batch, objective)
        return result if self.rank == 0 else None

    # ---- colocated memory ------------------------------------------------------------------------------
    def device_ids(self) -> Tuple[str, List[str]]:
        """(Ray node id, the GPU ids Ray gave this rank): where a colocated engine's TP rank must run."""
        return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]

    def offload(self) -> Dict[str, float]:
        """Optimizer state and gradient buffers to host memory; the memory resident now (``memory/sync/``)
        and the peak since :meth:`reload` (``memory/train/gpu_peak_allocated_gib``)."""
        if self.offloader is None:
            self.offloader = TrainerOffload(self.trainer.ddp, self.trainer.optimizer, self.trainer.module)
        peak = memory_snapshot("").get("gpu_peak_allocated_gib")
        self.offloader.offload()
        out = memory_snapshot("memory/sync/")
        out.pop("memory/sync/gpu_peak_allocated_gib", None)
        if peak is not None:
            out["memory/train/gpu_peak_allocated_gib"] = peak
        return out

    def reload(self) -> Dict[str, float]:
        """Back from host memory (engines have released theirs); the memory resident now (``memory/train/``)."""
        if self.offloader is not None:
            self.offloader.reload()
        reset_peak()
        out = memory_snapshot("memory/train/")
        out.pop("memory/train/gpu_peak_allocated_gib", None)
        return out

    def memory(self, prefix: str) -> Dict[str, float]:
        return memory_snapshot(prefix)

    def _require_loaded(self, what: str) -> None:
        if self.offloader is not None and self.offloader.offloaded:
            raise RuntimeError(f"{what}: the optimizer state and gradient buffers are offloaded to host memory "
                               "(colocated rollout phase); call reload() first")

    # ---- profiling -----------------------------------------------------------------------------------
    def start_profile(self, path: str, record_shapes: bool = False, with_stack: bool = False) -> None:
        self.capture = self.capture or Capture()
        self.capture.start(path, record_shapes, with_stack)

    def stop_profile(self) -> Optional[str]:
        return None if self.capture is None else self.capture.stop()

    # ---- checkpoints ----------------------------------------------------------------------------------
    def save_checkpoint(self, ckpt_cfg, extra: Dict[str, Any], step: int) -> str:
        self._require_loaded("save_checkpoint")
        return save_checkpoint(self.trainer, ckpt_cfg, extra, step=step)

    def load_checkpoint(self, root: str, step: Optional[int] = None):
        self._require_loaded("load_checkpoint")
        result = load_checkpoint(self.trainer, root, step)
        return result if self.rank == 0 else None

    def save_hf(self, path: str) -> None:
        save_hf_checkpoint(self.trainer.built, path)

    def shutdown(self) -> None:
        if self.beater is not None:
            self.beater.stop()
        if self.engine is not None:
            self.engine.shutdown()
        parallel.destroy()
