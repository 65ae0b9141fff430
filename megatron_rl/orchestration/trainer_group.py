"""The driver's handle on all trainer ranks: each call goes to every rank at once, with each rank's
data-parallel shard of the batch, and comes back as one result.

Megatron's collectives need every rank inside the same call, so a method is always invoked on all
actors before any result is awaited -- and submitted under one lock: the engine-recovery thread
(``engine_health.py``) also starts collective calls (:meth:`TrainerGroup.sync_engine`), and every rank's
actor must receive the calls in the same order. While a call runs, the ranks' heartbeats are checked
(``heartbeat.py``): a rank silent for ``cluster.stall_fail_s`` ends the wait with one clear error.
Per-sequence results (forward log-probs) come from one rank per
data-parallel replica and are put back together in batch order. The batch is split over data-parallel ranks contiguously, or, with a
token budget (``work`` given), balanced by estimated work (:func:`megatron_rl.training.token_budget.rank_rows`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import ray
import torch

from megatron_rl.objectives import ObjectiveConfig
from megatron_rl.orchestration import failures, heartbeat, ray_waits
from megatron_rl.orchestration.progress import ProgressBoard
from megatron_rl.training.batch import TrainBatch
from megatron_rl.training.results import ForwardResult, StepResult
from megatron_rl.training.token_budget import rank_rows


class TrainerGroup:
    def __init__(self, workers: List[Any], progress: Optional[ProgressBoard] = None,
                 work: Optional[Callable[[List[int]], List[float]]] = None):
        self.workers = workers
        self.infos: List[Dict[str, int]] = []
        self.progress = progress  # draws the bars the ranks report while a call runs
        self._submit_lock = threading.Lock()
        # the label of the weights the trainer holds once every submitted call has run: the last synced
        # version, or the step of the last submitted train step (what a restarted engine is given)
        self.weights_version = "default"
        self.work = work  # sequence lengths -> estimated work: balance the DP split by it (None: contiguous)
        self.stall: Optional[heartbeat.StallWatch] = None  # trainer heartbeats (start_heartbeat)

    def _submit(self, method: str, *args: Any, per_rank: Optional[List[tuple]] = None) -> List[Any]:
        return [getattr(w, method).remote(*(per_rank[i] if per_rank is not None else args))
                for i, w in enumerate(self.workers)]

    def _call(self, method: str, *args: Any, per_rank: Optional[List[tuple]] = None, version: Any = None) -> List[Any]:
        """``method`` on every rank; ``version``: the label of the weights the ranks hold after it."""
        with self._submit_lock:
            refs = self._submit(method, *args, per_rank=per_rank)
            if version is not None:
                self.weights_version = str(version)
        return self._get(refs, method)

    def _get(self, refs: List[Any], method: str, bars: bool = True) -> List[Any]:
        check = self.stall.check if self.stall is not None else None
        try:
            if self.progress is not None and bars:
                return self.progress.wait(refs, on_poll=check)
            return ray.get(refs) if check is None else _wait_checked(refs, check, self.stall.poll_s)
        except ray.exceptions.RayActorError as e:
            raise (self._settle(refs, method, 2.0) or failures.actor_death("a trainer rank", {}, method, e)) from None
        except ray.exceptions.RayTaskError as e:
            # a survivor's collective error ("connection closed by peer") is often in before the dead rank's
            dead = self._settle(refs, method, 60.0)
            if dead is not None:
                raise dead from None
            user = failures.from_ray_error(e)
            if user is None:
                raise
            raise user from None

    def _settle(self, refs: List[Any], method: str, timeout_s: float) -> Optional[failures.RunError]:
        """Fetch every rank's outcome within ``timeout_s`` (Ray would log the others' errors as "unhandled"; a
        failed call can be recovered from: engine recovery retries a weight sync) and name the first rank
        that died (its pid and log tail), if one did."""
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        done = set(ready)
        for rank, ref in enumerate(refs):
            if ref not in done:
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                who = self.infos[rank] if rank < len(self.infos) else {}
                return failures.actor_death(f"trainer rank {rank}", who, method, e)
            except Exception:  # noqa: BLE001 - another rank's (agreed) failure
                continue
        return None

    def _rank0(self, method: str, *args: Any) -> Any:
        return self._call(method, *args)[0]

    # ---- set-up --------------------------------------------------------------------------------------
    def setup(self) -> None:
        addr, port = ray_waits.get(self.workers[0].rendezvous_address.remote(), ray_waits.SHORT_S,
                                   "trainer rank 0's rendezvous address")
        self.infos = self._call("setup", addr, port)
        if self.progress is not None:
            self._call("set_progress", self.progress.reporter())

    def start_heartbeat(self, warn_s: float, fail_s: float) -> None:
        """Every rank beats to a board the driver watches (``heartbeat.py``); a rank silent for ``fail_s`` makes
        the driver's waits for trainer calls raise ``TrainerStallError``."""
        board = heartbeat.new_board()
        self._call("start_heartbeat", board, heartbeat.beat_interval(warn_s))
        self.stall = heartbeat.StallWatch(board, warn_s, fail_s).start()

    def stop_heartbeat(self) -> None:
        if self.stall is not None:
            self.stall.stop()

    @property
    def dp(self) -> int:
        return self.infos[0]["dp"]

    # ---- batches -------------------------------------------------------------------------------------
    def _shards(self, batch: TrainBatch) -> Tuple[List[Any], torch.Tensor]:
        """(each worker's shard, the batch row of every shard row in DP-rank order)."""
        rows = rank_rows(batch.seq_lengths, self.dp, self.work)
        shards = [ray.put(batch.select(r)) for r in rows]  # each shard serialised once
        return [shards[info["dp_rank"]] for info in self.infos], torch.cat(rows)

    def _gather(self, results: List[Any]) -> List[Any]:
        by_dp = {r[0]: r[1] for r in results if r is not None}
        return [by_dp[i] for i in range(self.dp)]

    def forward(self, batch: TrainBatch, objective: Optional[ObjectiveConfig] = None) -> ForwardResult:
        shards, order = self._shards(batch)
        parts = self._gather(self._call("forward", per_rank=[(s, objective) for s in shards]))
        return _concat_forward(parts, torch.argsort(order))

    def ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        shards, order = self._shards(batch)
        parts = self._gather(self._call("ref_logprobs", per_rank=[(s,) for s in shards]))
        return torch.cat(parts)[torch.argsort(order)]

    def train_step(self, batch: TrainBatch, objective: Optional[ObjectiveConfig] = None,
                   version: Any = None) -> StepResult:
        """One optimizer step; ``version``: the label of the weights it produces (the driver's step)."""
        shards, _ = self._shards(batch)
        return self._call("train_step", per_rank=[(s, objective) for s in shards], version=version)[0]

    # ---- weights and checkpoints ----------------------------------------------------------------------
    def connect_engines(self, urls: List[str], transport: str, policy: str, timeout_s: float,
                        pause_mode: Optional[str] = None, control_timeout_s: float = 30.0) -> None:
        self._call("connect_engines", urls, transport, policy, timeout_s, pause_mode, control_timeout_s)

    def sync_weights(self, version: Any, check: Optional[bool] = None):
        return self._call("sync_weights", version, check, version=version)[0]

    def sync_engine(self, index: int, url: str):
        """The trainer's current weights to engine ``index`` alone, restarted at ``url``, then the probe check
        (engine recovery). Returns ``SyncStats`` (its ``version``: ``weights_version`` when submitted)."""
        with self._submit_lock:
            refs = self._submit("sync_engine", index, url, self.weights_version)
        return self._get(refs, "sync_engine", bars=False)[0]  # no bars: the main thread may be drawing its own

    def check_weights(self, *what: str):
        return self._rank0("check_weights", *what)

    # ---- colocated memory (each returns the per-rank maximum of every memory metric) -------------------
    def offload(self) -> Dict[str, float]:
        return _max_over_ranks(self._call("offload"))

    def reload(self) -> Dict[str, float]:
        return _max_over_ranks(self._call("reload"))

    def memory(self, prefix: str) -> Dict[str, float]:
        return _max_over_ranks(self._call("memory", prefix))

    def device_ids(self) -> List[Any]:
        return self._call("device_ids")

    def save_checkpoint(self, ckpt_cfg, extra: Dict[str, Any], step: int) -> str:
        ref = ray.put(extra)  # one copy in the object store, read by every rank
        return self._rank0("save_checkpoint", ckpt_cfg, ref, step)

    def load_checkpoint(self, root: str, step: Optional[int] = None):
        return self._rank0("load_checkpoint", root, step)

    def save_hf(self, path: str) -> None:
        self._call("save_hf", path)

    # ---- profiling (not collective: only the chosen ranks) ---------------------------------------------
    def start_profile(self, ranks: List[int], path_of_rank, **options) -> None:
        ray_waits.get([self.workers[r].start_profile.remote(path_of_rank(r), **options) for r in ranks],
                      ray_waits.SHORT_S, "starting the trainer profiler")

    def stop_profile(self, ranks: List[int]) -> List[Optional[str]]:
        return ray_waits.get([self.workers[r].stop_profile.remote() for r in ranks], 600.0,
                             "writing the trainer profiles")


def _wait_checked(refs: List[Any], check: Callable[[], None], poll_s: float) -> List[Any]:
    """``ray.get(refs)``, calling ``check`` (which raises to stop waiting) every ``poll_s``; a finished call's
    error is raised as soon as it is in."""
    results: Dict[Any, Any] = {}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=poll_s)
        results.update(zip(ready, ray.get(ready)))  # each result fetched (deserialised) once
        check()
    return [results[r] for r in refs]


def _max_over_ranks(per_rank: List[Dict[str, float]]) -> Dict[str, float]:
    return {k: max(m[k] for m in per_rank if k in m) for k in per_rank[0]}


def _concat_forward(parts: List[ForwardResult], inverse: torch.Tensor) -> ForwardResult:
    """The DP ranks' results as one, rows back in batch order (``inverse``: batch row -> result row)."""
    fields = {}
    for f in dataclasses.fields(ForwardResult):
        values = [getattr(p, f.name) for p in parts]
        if not isinstance(values[0], torch.Tensor):
            fields[f.name] = values[0]  # None, or metrics already reduced over data parallelism
        else:  # DP shards keep the full batch's response width R (TrainBatch.select): they concatenate
            fields[f.name] = torch.cat(values)[inverse]
    return ForwardResult(**fields)
