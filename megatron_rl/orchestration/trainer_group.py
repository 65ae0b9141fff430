"""The driver's handle on all trainer ranks: each call goes to every rank at once, with each rank's
data-parallel shard of the batch, and comes back as one result.

Megatron's collectives need every rank inside the same call, so a method is always invoked on all
actors before any result is awaited. Per-sequence results (forward log-probs) come from one rank per
data-parallel replica and are put back together in batch order (``TrainBatch.split`` is contiguous).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import torch

from megatron_rl.objectives import ObjectiveConfig
from megatron_rl.orchestration.progress import ProgressBoard
from megatron_rl.training.batch import TrainBatch
from megatron_rl.training.results import ForwardResult, StepResult


class TrainerGroup:
    def __init__(self, workers: List[Any], progress: Optional[ProgressBoard] = None):
        self.workers = workers
        self.infos: List[Dict[str, int]] = []
        self.progress = progress  # draws the bars the ranks report while a call runs

    def _call(self, method: str, *args: Any, per_rank: Optional[List[tuple]] = None) -> List[Any]:
        import ray

        refs = [getattr(w, method).remote(*(per_rank[i] if per_rank is not None else args))
                for i, w in enumerate(self.workers)]
        return ray.get(refs) if self.progress is None else self.progress.wait(refs)

    def _rank0(self, method: str, *args: Any) -> Any:
        return self._call(method, *args)[0]

    # ---- set-up --------------------------------------------------------------------------------------
    def setup(self) -> None:
        import ray

        addr, port = ray.get(self.workers[0].rendezvous_address.remote())
        self.infos = self._call("setup", addr, port)
        if self.progress is not None:
            self._call("set_progress", self.progress.reporter())

    @property
    def dp(self) -> int:
        return self.infos[0]["dp"]

    # ---- batches -------------------------------------------------------------------------------------
    def _shards(self, batch: TrainBatch) -> List[TrainBatch]:
        import ray

        shards = [ray.put(s) for s in batch.split(self.dp)]  # each shard serialised once
        return [shards[info["dp_rank"]] for info in self.infos]

    def _gather(self, results: List[Any]) -> List[Any]:
        by_dp = {r[0]: r[1] for r in results if r is not None}
        return [by_dp[i] for i in range(self.dp)]

    def forward(self, batch: TrainBatch, objective: Optional[ObjectiveConfig] = None) -> ForwardResult:
        shards = self._shards(batch)
        parts = self._gather(self._call("forward", per_rank=[(s, objective) for s in shards]))
        return _concat_forward(parts)

    def ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        shards = self._shards(batch)
        return torch.cat(self._gather(self._call("ref_logprobs", per_rank=[(s,) for s in shards])))

    def train_step(self, batch: TrainBatch, objective: Optional[ObjectiveConfig] = None) -> StepResult:
        shards = self._shards(batch)
        return self._call("train_step", per_rank=[(s, objective) for s in shards])[0]

    # ---- weights and checkpoints ----------------------------------------------------------------------
    def connect_engines(self, urls: List[str], transport: str, policy: str, timeout_s: float) -> None:
        self._call("connect_engines", urls, transport, policy, timeout_s)

    def sync_weights(self, version: Any):
        return self._rank0("sync_weights", version)

    def check_weights(self):
        return self._rank0("check_weights")

    def save_checkpoint(self, ckpt_cfg, extra: Dict[str, Any], step: int) -> str:
        import ray

        ref = ray.put(extra)  # one copy in the object store, read by every rank
        return self._rank0("save_checkpoint", ckpt_cfg, ref, step)

    def load_checkpoint(self, root: str):
        return self._rank0("load_checkpoint", root)

    def save_hf(self, path: str) -> None:
        self._call("save_hf", path)

    # ---- profiling (not collective: only the chosen ranks) ---------------------------------------------
    def start_profile(self, ranks: List[int], path_of_rank, **options) -> None:
        import ray

        ray.get([self.workers[r].start_profile.remote(path_of_rank(r), **options) for r in ranks])

    def stop_profile(self, ranks: List[int]) -> List[Optional[str]]:
        import ray

        return ray.get([self.workers[r].stop_profile.remote() for r in ranks])


def _concat_forward(parts: List[ForwardResult]) -> ForwardResult:
    if len(parts) == 1:
        return parts[0]
    fields = {}
    for f in dataclasses.fields(ForwardResult):
        values = [getattr(p, f.name) for p in parts]
        if not isinstance(values[0], torch.Tensor):
            fields[f.name] = values[0]  # None, or metrics already reduced over data parallelism
        else:  # DP shards keep the full batch's response width R (TrainBatch.select): they concatenate
            fields[f.name] = torch.cat(values)
    return ForwardResult(**fields)
