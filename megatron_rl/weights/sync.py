"""Weight sync: the trainer's Megatron shards -> a rollout engine, then a check that they agree.

``WeightSync(built, engine, config).sync(version)`` is collective: every trainer rank calls it.

1. One rank, the *sender* (global rank 0 by default), holds the engine handle. Every other rank that owns
   part of the weights (its TP / EP / PP shard; DP replicas own nothing) sends those pieces straight to the
   sender, concurrently, cast to the engine's dtype (:mod:`megatron_rl.weights.links`, ``per_rank``,
   the default): an in-process ``EmbeddedEngine`` receives each piece in place into its parameters; for any
   other engine the sender assembles full HF tensors from the pieces as it streams them. (``per_rank=False``,
   and colocated transports: every rank iterates :func:`megatron_rl.models.weights.iter_hf_weights`, which
   gathers every tensor on every rank.)
2. The sender groups the full tensors into buckets of at most ``bucket_mb`` (a larger tensor travels
   alone). Buckets are built lazily and handed to ``engine.update_weights`` as a generator, so bucket
   ``k`` is on its way while bucket ``k + 1`` is assembled: the extra memory is about two buckets plus the
   tensor being assembled, never a second copy of the model.
3. The transport is the engine's own (reused, not re-implemented here): ``EmbeddedEngine`` copies in
   process; ``RemoteEngine`` posts safetensors buckets to ``/update_weights_from_tensor``
   (``weight_transport="tensor"``) or announces each bucket on ``/update_weights_from_distributed`` and
   broadcasts it over the weight group (``"distributed"``; call ``engine.init_weight_sync(...)`` once).
   Colocated engines instead take a ``transport`` (:class:`~megatron_rl.rollout.client.ipc_transport.IpcTransport`)
   that *every* rank feeds with its own buckets: each rank beside an engine TP rank hands over its own
   copy by handle (``"ipc"``); the sender then only runs the check.
4. The check (``config.check``): every rank runs the Megatron model on a fixed pseudo-random probe
   sequence; the last pipeline stage turns its vocab-sharded logits into per-token log-probs with
   ``ops.vocab_parallel_stats`` and broadcasts them over PP; the sender asks every engine replica for
   its teacher-forced log-probs of the same sequence (``RolloutEngine.prompt_logprobs``) and compares.
   Random tokens exercise every layer's weights at once. Measured (tests/distributed/test_weight_sync.py):
   fp32 on CPU, float noise <= 2e-6 (tolerance 1e-4) against 0.09 for one tensor left stale after a
   ~10% update and 3.1 for two swapped tensors (mean 0.69). A bf16 engine's noise grows with the size of
   the logits as training sharpens the model (the tiny MoE recipe: max 0.03 at the start, 0.32 at one
   position by step 80, mean 0.03): its check bounds the mean |diff| (0.1) and the max loosely (1.0), which
   still catches garbling (swaps, wrong layouts, missing tensors) but not one tensor a single step stale.
5. The outcome is agreed on by all ranks (one ``all_gather_object``): every rank returns the same
   :class:`SyncStats`, or raises -- the rank that failed its original exception, the others a
   :class:`WeightSyncError` (a :class:`WeightMismatchError` for a failed check) with the same message.
   An engine failure part-way never leaves other ranks hanging in a gather: the sender drains the
   export to the end first.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_rl.config.rollout import WeightSyncConfig  # noqa: F401 - imported from here too
from megatron_rl.models import mapping
from megatron_rl.models.weights import iter_hf_weights
from megatron_rl.weights import links as weight_links
from megatron_rl.weights.group import dtype_from_name, dtype_name
from megatron_rl.weights.probe import (  # noqa: F401 - the check's errors and records are the sync's API too
    ProbeCheck,
    WeightMismatchError,
    WeightSyncError,
    compare_logprobs,
    probe_length,
    probe_tokens,
    trainer_probe_logprobs,
)
from megatron_rl.weights.receiver import WeightReceiver, receives_in_place, weights_dtype

log = logging.getLogger(__name__)
MiB = 1 << 20


@dataclass
class SyncStats:
    """What one sync moved and how long it took (the sender's numbers, agreed on every rank).

    ``seconds``: the whole call. ``transfer_seconds``: export + send. ``gather_seconds``: of that, the
    time spent producing tensors (gathers, PP broadcasts, casts); the rest is the engine receiving.
    ``bytes``: payload in the engine dtype. ``bucket_bytes[i]`` / ``bucket_tensors[i]``: bucket ``i`` (none
    when an in-process engine received the pieces in place). ``link_bytes[r]`` / ``link_seconds[r]``: what
    trainer rank ``r`` sent and how long it took (its own clock).
    """

    version: str
    seconds: float
    transfer_seconds: float
    gather_seconds: float
    bytes: int
    buckets: int
    tensors: int
    dtype: str
    bucket_bytes: List[int] = field(default_factory=list)
    bucket_tensors: List[int] = field(default_factory=list)
    check: Optional[ProbeCheck] = None
    link_bytes: List[int] = field(default_factory=list)  # per trainer rank (group rank): bytes it sent
    link_seconds: List[float] = field(default_factory=list)  # per trainer rank: from its start to its last byte
    transaction: Any = None  # a weights.transaction.TransactionReport (TransactionalSync): per engine, per phase
    flush_refused: int = 0  # engines that refused /flush_cache after this sync (an in-place pause: old-weights KV kept)

    @property
    def max_bucket_bytes(self) -> int:
        return max(self.bucket_bytes, default=0)

    def metrics(self, prefix: str = "weight_sync/") -> Dict[str, float]:
        out = dict(seconds=self.seconds, transfer_seconds=self.transfer_seconds, gather_seconds=self.gather_seconds,
                   bytes=float(self.bytes), buckets=float(self.buckets), tensors=float(self.tensors),
                   gb_per_s=self.bytes / 1e9 / max(self.transfer_seconds, 1e-9))
        if self.check is not None:
            out.update(check_max_abs_diff=self.check.max_abs_diff, check_mean_abs_diff=self.check.mean_abs_diff,
                       check_seconds=self.check.seconds)
        out.update(self.link_metrics(prefix=""))
        return {prefix + k: float(v) for k, v in out.items()}

    def link_metrics(self, prefix: str = "weight_sync/") -> Dict[str, float]:
        """``link<r>/bytes`` and ``link<r>/gb_per_s`` for every trainer rank ``r`` that sent something."""
        out = {}
        for r, (n, s) in enumerate(zip(self.link_bytes, self.link_seconds)):
            if n:
                out[f"{prefix}link{r}/bytes"] = float(n)
                out[f"{prefix}link{r}/gb_per_s"] = n / 1e9 / max(s, 1e-9)
        return out


# ------------------------------------------------------------------------------------------------
# Buckets
# ------------------------------------------------------------------------------------------------


def iter_buckets(named: Iterable[Tuple[str, torch.Tensor]], max_bytes: int,
                 dtype: Optional[torch.dtype] = None) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs, cast to ``dtype``, into lists of at most ``max_bytes`` bytes; a
    tensor larger than ``max_bytes`` forms a bucket of its own. Lazy: reads one tensor past the bucket."""
    bucket: List[Tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        if dtype is not None and t.dtype != dtype and t.is_floating_point():
            t = t.to(dtype)  # same dtype: no copy (the bucket may alias parameters until it is sent)
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


class _Meter:
    """Wraps the sender's bucket stream: bucket sizes, time spent producing, a progress bar over bytes
    (drawn here, or by whoever ``report(desc, done, total, unit)`` reports to)."""

    def __init__(self, total_bytes: int, desc: str, progress: bool, report=None):
        self.desc, self.total, self.report = desc, total_bytes, report if progress else None
        self.sent = 0
        self.bar = tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                        disable=not progress or report is not None, mininterval=0.5, leave=False)
        self.gather_s = 0.0
        self.bucket_bytes: List[int] = []
        self.bucket_tensors: List[int] = []

    def wrap(self, buckets: Iterator[List[Tuple[str, torch.Tensor]]]):
        t = time.perf_counter()
        for bucket in buckets:
            self.gather_s += time.perf_counter() - t
            nbytes = sum(x.numel() * x.element_size() for _, x in bucket)
            self.bucket_bytes.append(nbytes)
            self.bucket_tensors.append(len(bucket))
            yield bucket
            self.sent += nbytes  # the engine asked for the next bucket: this one is through
            self.bar.update(nbytes)
            if self.report is not None:
                self.report(self.desc, self.sent, self.total, "B")
            t = time.perf_counter()

    def close(self) -> None:
        self.bar.close()


def _drain(it: Iterator) -> int:
    return sum(1 for _ in it)


# ------------------------------------------------------------------------------------------------
# The sync
# ------------------------------------------------------------------------------------------------


def _engine_dtype(config: WeightSyncConfig, engine: Optional[WeightReceiver], built) -> torch.dtype:
    if config.engine_dtype is not None:
        return dtype_from_name(config.engine_dtype)
    own = weights_dtype(engine) if engine is not None else None
    return own if own is not None else built.tconfig.params_dtype  # SGLang does not report its dtype: engine_dtype


class WeightSync:
    """Trainer -> engine weight sync with a post-sync log-prob check (module doc). Collective.

    ``engine`` is needed on the sender only (other ranks pass None). ``group``: all trainer ranks
    (None: the default world); ``sender_rank``: the global rank that talks to the engine. ``transport``
    (every rank, e.g. an ``IpcTransport``): ``update_weights(buckets, version)`` called on every rank with
    its own buckets instead of the sender's ``engine.update_weights``; the engine then serves the check.
    """

    def __init__(self, built, engine: Optional[WeightReceiver], config: Optional[WeightSyncConfig] = None, *,
                 sender_rank: int = 0, group: Optional[dist.ProcessGroup] = None, transport: Any = None):
        self.built, self.engine, self.transport = built, engine, transport
        self.config = config or WeightSyncConfig()
        self.group = group
        distributed = dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world = dist.get_world_size(group) if distributed else 1
        self.sender_rank = sender_rank
        self.is_sender = self.rank == sender_rank
        self.progress = None  # optional report(desc, done, total, unit), e.g. a driver-side bar (sender only)
        if self.is_sender and engine is None:
            raise ValueError(f"rank {self.rank} is the weight-sync sender (sender_rank={sender_rank}): give it the "
                             "rollout engine")
        if self.config.replay_routing and not (built.arch.is_moe and built.tconfig.moe_enable_routing_replay):
            raise ValueError("WeightSyncConfig.replay_routing needs an MoE model built with routing replay "
                             "(ModelConfig.routing_replay=True)")
        self.dtype = _engine_dtype(self.config, engine, built)
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.total_bytes = sum(math.prod(s) * elem for s in mapping.hf_shapes(built.arch).values())
        self.probe = probe_tokens(built.vocab_size, probe_length(self.config, built), self.config.probe_seed)
        self.group_rank = dist.get_rank(group) if distributed else 0
        self.sender_group_rank = sender_rank if group is None or not distributed else dist.get_group_rank(group,
                                                                                                          sender_rank)
        self._plan = None  # weight_links.Plan: who sends which pieces (exchanged at the first per-rank sync)

    # ---- agreement between ranks -------------------------------------------------------------------

    def _agree(self, error: Optional[BaseException], result: Any = None, link: Tuple[int, float] = (0, 0.0)) -> Any:
        """Every rank learns every rank's error and the sender's result (a SyncStats gets every rank's ``link``:
        bytes sent, seconds); raise on all ranks if any failed."""
        mine = (None if error is None else (type(error).__name__, str(error), isinstance(error, WeightMismatchError)),
                result if self.is_sender else None, link)
        if self.world > 1:
            gathered: List[Any] = [None] * self.world
            dist.all_gather_object(gathered, mine, group=self.group)
        else:
            gathered = [mine]
        if error is not None:
            raise error
        failed = [(r, e) for r, (e, _, _) in enumerate(gathered) if e is not None]
        if failed:
            r, (kind, message, mismatch) = failed[0]
            cls = WeightMismatchError if mismatch else WeightSyncError
            raise cls(f"weight sync failed on rank {r} ({kind}): {message}")
        result = gathered[self.sender_group_rank][1]
        if isinstance(result, SyncStats):
            result.link_bytes = [int(g[2][0]) for g in gathered]
            result.link_seconds = [float(g[2][1]) for g in gathered]
        return result

    # ---- API ------------------------------------------------------------------------------------------

    def sync(self, version: Any, check: Optional[bool] = None) -> SyncStats:
        """Push the trainer's current weights to the engine as ``version``, then check (``check``: None ->
        ``config.check``; colocated engines are checked after their KV cache is back, by :meth:`check`)."""
        start = time.perf_counter()
        version = str(version)
        error: Optional[BaseException] = None
        stats, link = None, (0, 0.0)
        try:
            if self.transport is None and self.config.per_rank:
                stats, link = self._send_per_rank(version)
            else:
                source = iter_hf_weights(self.built, all_stages=True)
                if self.is_sender or self.transport is not None:
                    stats = self._send(source, version)
                    link = (stats.bytes, time.perf_counter() - start)  # every rank has every tensor: one link
                else:
                    _drain(source)
        except Exception as e:  # noqa: BLE001 - reported to every rank by _agree
            error = e
        if self.is_sender and stats is not None:
            stats.transfer_seconds = time.perf_counter() - start
        stats = self._agree(error, stats, link)
        if self.config.check if check is None else check:
            stats.check = self.check(what=f"after syncing version {version}")
        stats.seconds = time.perf_counter() - start
        if self.is_sender:
            log.info("weight sync v%s: %.1f MiB (%s) in %d buckets, %d tensors, %.2f s%s", version, stats.bytes / MiB,
                     stats.dtype, stats.buckets, stats.tensors, stats.seconds,
                     f"; probe max |dlogp| {stats.check.max_abs_diff:.2e}" if stats.check else "")
        return stats

    def _send_per_rank(self, version: str) -> Tuple[Optional[SyncStats], Tuple[int, float]]:
        """Every rank sends its own pieces to the sender (links.py); returns (the sender's stats, this
        rank's link: bytes, seconds)."""
        if self._plan is None:
            direct = self.is_sender and receives_in_place(self.engine)
            self._plan = weight_links.exchange_plan(self.built, self.group, self.sender_group_rank,
                                                    self.dtype if self.is_sender else None, direct)
            self.dtype = self._plan.dtype
        plan, me = self._plan, self.group_rank
        if not self.is_sender:
            return None, (weight_links.send_pieces(self.built, plan, self.sender_rank, self.group)
                          if plan.pieces[me] else (0, 0.0))
        start = time.perf_counter()
        if not plan.direct:
            stats = self._send(weight_links.assemble_stream(self.built, plan, me, self.group,
                                                           deadline=self._stream_deadline()), version)
            return stats, (plan.link_bytes(me), time.perf_counter() - start)
        error: Optional[BaseException] = None
        with contextlib.ExitStack() as stack:
            try:
                target = stack.enter_context(self.engine.weight_update(version))
            except Exception as e:  # noqa: BLE001 - the peers' pieces are still received (and dropped)
                target, error = None, e
            weight_links.receive_into(self.built, plan, me, self.group, target, self.config.bucket_bytes)
        if error is not None:
            raise error
        total = sum(plan.link_bytes(r) for r in range(len(plan.pieces)))
        names = len({p.name for ps in plan.pieces for p in ps})
        if self.progress is not None:
            self.progress(f"weight sync v{version}", total, total, "B")
        return (SyncStats(version=version, seconds=0.0, transfer_seconds=0.0, gather_seconds=0.0, bytes=total,
                          buckets=0, tensors=names, dtype=dtype_name(self.dtype)),
                (plan.link_bytes(me), time.perf_counter() - start))

    def _send(self, source: Iterator[Tuple[str, torch.Tensor]], version: str) -> SyncStats:
        meter = _Meter(self.total_bytes, f"weight sync v{version}", self.config.progress and self.is_sender,
                       self.progress if self.is_sender else None)
        consumer = self.transport if self.transport is not None else self.engine
        error: Optional[BaseException] = None
        # Producing a bucket runs collectives, so the engine must pull buckets from this thread, one at a
        # time (EmbeddedEngine and RemoteEngine do; RemoteEngine's pool threads only do the HTTP calls).
        refused_before = sum(getattr(consumer, "flush_refused", ()))
        try:
            consumer.update_weights(meter.wrap(iter_buckets(source, self.config.bucket_bytes, self.dtype)), version)
        except Exception as e:  # noqa: BLE001 - re-raised below, after the drain
            error = e
        finally:
            meter.close()
        # The other ranks are still gathering: finish the export so no collective is left unmatched.
        left = _drain(source)
        if error is not None:
            raise error
        if left:
            raise WeightSyncError(f"{type(consumer).__name__}.update_weights returned without consuming every "
                                  f"bucket ({left} tensors were never sent)")
        return SyncStats(version=version, seconds=0.0, transfer_seconds=0.0, gather_seconds=meter.gather_s,
                         bytes=sum(meter.bucket_bytes), buckets=len(meter.bucket_bytes),
                         tensors=sum(meter.bucket_tensors), dtype=dtype_name(self.dtype),
                         bucket_bytes=meter.bucket_bytes, bucket_tensors=meter.bucket_tensors,
                         flush_refused=sum(getattr(consumer, "flush_refused", ())) - refused_before)

    def _stream_deadline(self):
        return None  # TransactionalSync: the transaction's deadline

    def check(self, what: str = "") -> ProbeCheck:
        """Compare every engine replica's log-probs of the probe with the trainer's (collective). Also
        useful before the first sync: the engine must have been started from the trainer's checkpoint.

        With ``config.replay_routing`` (MoE) the engines score the probe first and report their routing of
        it; the trainer's probe forward replays each replica's routing in turn, so a bf16 engine's routing
        flips (which move a token's log-prob by ~1) do not read as garbled weights."""
        start = time.perf_counter()
        error: Optional[BaseException] = None
        result = None
        try:
            if self.config.replay_routing:
                replicas = self._engine_probe_with_routes()
                trainers = [trainer_probe_logprobs(self.built, self.probe, routes) for _, routes in replicas]
            else:
                replicas, trainers = None, None
                trainer = trainer_probe_logprobs(self.built, self.probe)
        except Exception as e:  # noqa: BLE001
            error = e
        if self.is_sender and error is None:
            try:
                if replicas is None:
                    replicas = [(lp, None) for lp in self.engine.prompt_logprobs(self.probe.tolist())]
                    trainers = [trainer] * len(replicas)
                result = self._compare(trainers, [lp for lp, _ in replicas], what)
            except Exception as e:  # noqa: BLE001
                error = e
        if result is not None:
            result.seconds = time.perf_counter() - start
        return self._agree(error, result)

    def _engine_probe_with_routes(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Every replica's ``(log-probs, routing)`` of the probe, on every rank (the sender asks, then broadcasts
        them: every rank's probe forward replays them). An engine failure is raised on every rank."""
        answer: List[Any] = [None]
        if self.is_sender:
            try:
                answer[0] = ("ok", [(torch.as_tensor(lp).float().cpu(), torch.as_tensor(r).cpu())
                                    for lp, r in self.engine.prompt_logprobs_and_routes(self.probe.tolist())])
            except Exception as e:  # noqa: BLE001 - sent to every rank
                answer[0] = ("error", f"{type(e).__name__}: {e}")
        if self.world > 1:
            dist.broadcast_object_list(answer, src=self.sender_rank, group=self.group)
        kind, payload = answer[0]
        if kind == "error":
            raise WeightSyncError(f"the engine could not score the probe with its routing: {payload}")
        return payload

    def _compare(self, trainers: List[torch.Tensor], replicas: List[torch.Tensor], what: str) -> ProbeCheck:
        urls = [getattr(c, "url", None) for c in getattr(self.engine, "clients", [])]
        worst = None
        for i, (trainer, engine_lp) in enumerate(zip(trainers, replicas)):
            where = f"replica {i}" + (f" ({urls[i]})" if i < len(urls) and urls[i] else "")
            where = f"{type(self.engine).__name__} {where}" + (f" {what}" if what else "")
            try:
                high, mean = self.config.tolerances(self.dtype)
                res = compare_logprobs(trainer, torch.as_tensor(engine_lp).float().cpu(), high, self.probe, where,
                                       mean)
            except WeightMismatchError as e:
                e.replica = i
                raise
            if worst is None or res.max_abs_diff > worst.max_abs_diff:
                worst = res
        if worst is None:
            raise WeightSyncError(f"{type(self.engine).__name__}.prompt_logprobs returned no replica")
        return worst

