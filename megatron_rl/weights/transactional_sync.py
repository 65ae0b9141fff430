"""``TransactionalSync``: :class:`~megatron_rl.weights.sync.WeightSync` as a fleet transaction (stage -> verify ->
commit, :mod:`megatron_rl.weights.transaction`) for a RemoteEngine sender (``tensor`` / ``distributed`` transports).

Collective like WeightSync. The sender stages the buckets through ``engine.stage_weights`` (per-engine failures,
the deadline on every call), the probe check runs per engine (every rank's probe forward; the sender compares each
engine on its own), and ``engine.commit_weights`` flips the version on the verified engines only. Engine failures
do not raise: they are in ``SyncStats.transaction`` (``failures``), for the engine monitor to take those engines
out of rotation. When no engine commits, every rank raises the same
:class:`~megatron_rl.weights.transaction.TransactionError` naming each engine, its phase and cause. A trainer-side
failure raises as in WeightSync.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_rl.models.weights import iter_hf_weights
from megatron_rl.weights.deadline import TrainerStalled, default_timeout_s
from megatron_rl.weights.probe import ProbeCheck, WeightMismatchError, compare_logprobs, trainer_probe_logprobs
from megatron_rl.weights.sync import SyncStats, WeightSync
from megatron_rl.weights.transaction import SyncTransaction, failures_text

log = logging.getLogger("megatron_rl.weights.sync")


def supports_transactions(weight_transport: str) -> bool:
    """The RemoteEngine transports a transaction drives (``ipc`` and in-process engines keep WeightSync's path).
    Decided from the run's transport, not the engine: every rank must pick the same class."""
    return weight_transport in ("tensor", "distributed")


class TransactionalSync(WeightSync):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._txn: Optional[SyncTransaction] = None
        self.last_gb_per_s: Optional[float] = None  # the link's rate at the last sync: the next default deadline

    def timeout_s(self) -> float:
        if self.config.timeout_s is not None:
            return float(self.config.timeout_s)
        return default_timeout_s(self.total_bytes, self.last_gb_per_s)

    def sync(self, version: Any, check: Optional[bool] = None) -> SyncStats:
        start = time.perf_counter()
        version = str(version)
        txn = self._txn = self.engine.begin_transaction(version, self.timeout_s()) if self.is_sender else None
        try:
            stats = self._stage(version, start)
            result = self._verify_and_commit(version, txn, self.config.check if check is None else check)
        finally:
            self._txn = None
        stats.check = result[0]
        stats.transaction = result[1]
        stats.seconds = time.perf_counter() - start
        if stats.transfer_seconds > 0:
            self.last_gb_per_s = stats.bytes / 1e9 / stats.transfer_seconds
        report = stats.transaction
        if self.is_sender:
            failed = failures_text(report.failures)
            log.info("weight sync v%s: %.1f MiB in %d buckets, %.2f s; committed on engines %s%s", version,
                     stats.bytes / 2**20, stats.buckets, stats.seconds, report.committed,
                     f"; FAILED: {failed}" if failed else "")
        return stats

    def _stage(self, version: str, start: float) -> SyncStats:
        """WeightSync's transfer (its ``_send`` stages, below); fails every rank on a trainer-side error, or when no
        engine survived the stage."""
        error: Optional[BaseException] = None
        stats, link = None, (0, 0.0)
        try:
            if self.config.per_rank:
                stats, link = self._send_per_rank(version)
            else:
                source = iter_hf_weights(self.built, all_stages=True)
                stats = self._send(source, version) if self.is_sender else None
                if not self.is_sender:
                    for _ in source:
                        pass
                else:
                    link = (stats.bytes, time.perf_counter() - start)
            if self.is_sender:
                self._txn.raise_if_none_alive("stage")
        except TrainerStalled:
            # the stalled rank cannot join an agreement: abort the trainer's group (NCCL: its communicator; gloo
            # already closed the pair whose receive timed out) so no rank waits on it, and fail now, in the deadline.
            # Not destroy_process_group(None): that would also tear down the weight group this rank hosts.
            log.error("weight sync v%s: a trainer rank stalled; aborting the trainer's process group", version)
            group = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
            try:
                group.abort()
            except Exception as e:  # noqa: BLE001 - the error below is what matters
                log.warning("aborting the trainer's process group: %s", e)
            raise
        except Exception as e:  # noqa: BLE001 - reported to every rank by _agree
            error = e
        if self.is_sender and stats is not None:
            stats.transfer_seconds = time.perf_counter() - start
        return self._agree(error, stats, link)

    def _stream_deadline(self):
        """The sender's receives of the peers' pieces end at the transaction's deadline (a stalled trainer rank)."""
        return self._txn.deadline if self._txn is not None else None

    def _send(self, source, version: str) -> SyncStats:
        """The sender's buckets go through ``engine.stage_weights`` (per-engine failures) instead of
        ``update_weights``: WeightSync._send with the consumer swapped."""
        txn, engine = self._txn, self.engine

        class _Stager:
            flush_refused = property(lambda _: getattr(engine, "flush_refused", ()))  # SyncStats.flush_refused

            def update_weights(self, buckets, version):
                engine.stage_weights(buckets, txn)

        real, self.engine = self.engine, _Stager()
        try:
            return super()._send(source, version)
        finally:
            self.engine = real

    def _verify_and_commit(self, version: str, txn: Optional[SyncTransaction], check: bool
                           ) -> Tuple[Optional[ProbeCheck], Any]:
        """Collective: the probe check per engine (every rank's probe forward), then the commit on the sender."""
        error: Optional[BaseException] = None
        worst: Optional[ProbeCheck] = None
        try:
            if check:
                worst = self._verify(txn, version)
            if self.is_sender:
                self.engine.commit_weights(txn)
                if not txn.report.committed:
                    raise txn._error("commit" if check else "stage")
        except Exception as e:  # noqa: BLE001 - reported to every rank
            error = e
        return self._agree(error, (worst, txn.report if txn is not None else None))

    def _verify(self, txn: Optional[SyncTransaction], version: str) -> Optional[ProbeCheck]:
        """Every rank: the trainer's probe log-probs (per engine's routing with replay); the sender: each engine's,
        compared on its own. Returns the worst check among the verified engines."""
        start = time.perf_counter()
        routes = self.config.replay_routing
        answers: List[Any] = [None]
        if self.is_sender:
            got = self.engine.probe_each(txn, self.probe.tolist(), routes=routes)
            answers[0] = {i: ((torch.as_tensor(a[0]).float().cpu(), torch.as_tensor(a[1]).cpu()) if routes else
                              (torch.as_tensor(a).float().cpu(), None)) for i, a in got.items()}
        if routes and self.world > 1:
            dist.broadcast_object_list(answers, src=self.sender_rank, group=self.group)
        if routes:
            trainers = {i: trainer_probe_logprobs(self.built, self.probe, r) for i, (_, r) in answers[0].items()}
        else:
            plain = trainer_probe_logprobs(self.built, self.probe)
        if not self.is_sender:
            return None
        worst = None
        high, mean = self.config.tolerances(self.dtype)
        for i, (lp, _) in sorted(answers[0].items()):
            where = f"engine {i} ({self.engine.clients[i].url}) after syncing version {version}"
            try:
                res = compare_logprobs(trainers[i] if routes else plain, lp, high, self.probe, where, mean)
            except WeightMismatchError as e:
                txn.fail(i, "verify", e)
                continue
            if worst is None or res.max_abs_diff > worst.max_abs_diff:
                worst = res
        if worst is not None:
            worst.seconds = time.perf_counter() - start
        return worst


def transaction_metrics(stats: SyncStats) -> Dict[str, float]:
    return stats.transaction.metrics() if stats is not None and stats.transaction is not None else {}
