"""RemoteEngine's side of the weight-sync transaction (:mod:`megatron_rl.weights.transaction`; mixed into
:class:`~megatron_rl.rollout.client.balancer.RemoteEngine`): stage the buckets on every engine with per-engine
failures, score the probe per engine, flip the version only on the engines the caller verified.

Every HTTP call of a transaction runs on a copy of the engine's client whose timeout is what is left of the
deadline, and is waited on no longer than that: a server that stops answering (SIGSTOP, a wedged scheduler) is
failed at its phase when the deadline passes, never waited on. ``tensor`` transport: a failed engine gets no more
buckets, the others go on. ``distributed``: the buckets are one broadcast over one group, so a failure (or the
deadline, enforced by a watchdog that destroys the group under a blocked broadcast) breaks the group for all its
engines; the engine that caused it is named, the others fail with "the weight group broke" and the group is rebuilt
for the next sync.
"""

from __future__ import annotations

import concurrent.futures
import copy
import logging
from typing import Any, Callable, Dict, Iterable, List, Optional

from megatron_rl.weights import group as weight_group
from megatron_rl.weights.checksum import bucket_checksum
from megatron_rl.weights.deadline import Deadline, SyncTimeout, Watchdog
from megatron_rl.weights.transaction import SyncTransaction

log = logging.getLogger("megatron_rl.rollout.client.balancer")


class TransactionalUpdates:
    """``begin_transaction``, ``stage_weights``, ``probe_each``, ``commit_weights`` for RemoteEngine."""

    def begin_transaction(self, version: Any, timeout_s: float) -> SyncTransaction:
        return SyncTransaction(str(version), [c.url for c in self.clients],
                               Deadline(timeout_s, f"weight sync v{version}"))

    # ---- per-engine calls under the deadline ------------------------------------------------------------

    def _bounded(self, i: int, deadline: Deadline):
        client = copy.copy(self.clients[i])  # same server and settings; its own timeout
        client.timeout_s = deadline.call_bound(self.clients[i].timeout_s)
        return client

    def _on_alive(self, txn: SyncTransaction, phase: str, fn: Callable, indices: Optional[List[int]] = None
                  ) -> Dict[int, Any]:
        """``fn(client)`` on every alive engine concurrently, each waited on until the deadline; a failure (or no
        answer by then) fails that engine at ``phase``. Returns the answers of the others."""
        targets = txn.alive() if indices is None else [i for i in indices if i in txn.alive()]
        futures = {i: self._pool.submit(fn, self._bounded(i, txn.deadline)) for i in targets}
        return self._collect(txn, phase, futures)

    def _collect(self, txn: SyncTransaction, phase: str, futures: Dict[int, concurrent.futures.Future]
                 ) -> Dict[int, Any]:
        out = {}
        for i, f in futures.items():
            try:
                out[i] = f.result(timeout=txn.deadline.call_bound() + 1.0)  # the call's own timeout ends it first
            except concurrent.futures.TimeoutError:
                txn.fail(i, phase, SyncTimeout(f"no answer within {txn.deadline.call_bound():.1f} s (a share of the "
                                               f"sync's deadline, {txn.deadline.seconds:.1f} s: "
                                               "rollout.weights.sync.timeout_s)"))
            except Exception as e:  # noqa: BLE001 - this engine's failure, not the transaction's
                txn.fail(i, phase, e)
        return out

    # ---- stage --------------------------------------------------------------------------------------------

    def stage_weights(self, named_tensor_buckets: Iterable, txn: SyncTransaction) -> None:
        """Every bucket to every engine still alive, inside the update session (and the pause, if any). Consumes
        every bucket even when all engines failed (producing them runs the trainer ranks' collectives)."""
        if self.weight_transport not in ("tensor", "distributed"):
            raise RuntimeError(f"weight_transport={self.weight_transport!r} has no transactional stage")
        with txn.phase("stage"):
            if self.weight_transport == "distributed" and self._group is None:
                for i in txn.alive():
                    txn.fail(i, "stage", "the weight group is not built (init_weight_sync first)")
            if self.pause_mode is not None:
                self._on_alive(txn, "stage", lambda c: c.pause_generation(self.pause_mode))
            # whether each server verifies checksums: asked once per client, kept on it (the per-call copies inherit it)
            for i, takes in self._on_alive(txn, "stage", lambda c: c.takes_checksums).items():
                self.clients[i]._takes_checksums = takes
            self._on_alive(txn, "stage", lambda c: c.begin_weight_update())
            pending = None
            try:
                for bucket in named_tensor_buckets:
                    bucket = list(bucket)
                    if pending is not None:
                        pending()
                        pending = None
                    if txn.alive():
                        pending = self._stage_bucket(bucket, txn)
                if pending is not None:
                    pending()
            except BaseException:  # the trainer's side failed: close the sessions, resume generation, re-raise
                self._on_alive(txn, "stage", lambda c: c.end_weight_update())
                if self.pause_mode is not None:
                    self._on_alive(txn, "stage", lambda c: c.continue_generation())
                raise
            self._on_alive(txn, "stage", lambda c: c.end_weight_update())
            self._on_alive(txn, "stage", self._flush)
            if self.pause_mode is not None:
                self._on_alive(txn, "stage", lambda c: c.continue_generation())

    def _stage_bucket(self, bucket: List, txn: SyncTransaction) -> Callable[[], None]:
        if txn.deadline.expired:
            for i in txn.alive():
                txn.fail(i, "stage", SyncTimeout(f"the deadline of {txn.deadline.seconds:.1f} s passed before every "
                                                 "bucket was sent (rollout.weights.sync.timeout_s)"))
            return lambda: None
        checksum = bucket_checksum(bucket)
        if self.weight_transport == "tensor":
            futures = {i: self._pool.submit(self._bounded(i, txn.deadline).update_weights_from_tensor, [bucket],
                                            [checksum]) for i in txn.alive()}
            return lambda: self._collect(txn, "stage", futures)
        fmt = weight_group.FLATTENED if weight_group.can_flatten(bucket) else None
        targets = txn.alive()
        announces = {i: self._pool.submit(self._bounded(i, txn.deadline).update_weights_from_distributed, bucket,
                                          self._group_name, fmt, checksum) for i in targets}
        works = weight_group.broadcast_bucket_async(self._group, bucket, fmt)
        return lambda: self._finish_staged_broadcast(txn, announces, works)

    def _finish_staged_broadcast(self, txn: SyncTransaction, announces: Dict[int, concurrent.futures.Future],
                                 works: List) -> None:
        group = self._group
        error: Optional[BaseException] = None
        with Watchdog(txn.deadline, lambda: self._abort_group(group), "the weight broadcast") as dog:
            try:
                self._finish_broadcast(list(announces.values()), works, deadline=txn.deadline,
                                       clients=[self.clients[i] for i in announces])
            except Exception as e:  # noqa: BLE001 - attributed below
                error = e
        if error is None:
            return
        if not dog.fired:
            self._abort_group(group)  # the survivors' receives end (their peer is gone) instead of timing out
        self._group = None  # broken: rebuilt by the next init_weight_sync
        txn.report.aborted = True
        for i, f in announces.items():  # the culprits: a refused announce, or none answered by the deadline
            if f.done() and f.exception() is not None:
                txn.fail(i, "stage", f.exception())
            elif not f.done() and isinstance(error, TimeoutError):
                txn.fail(i, "stage", error)
        named = [f.index for f in txn.report.failures]
        cause = (f"the weight group broke ({type(error).__name__}: {error})"
                 + (f" because of engine(s) {named}" if named else ""))
        for i in txn.alive():
            txn.fail(i, "stage", cause)

    def _abort_group(self, group) -> None:
        abort = getattr(group, "abort", None)
        if callable(abort):
            try:
                abort()
                return
            except Exception as e:  # noqa: BLE001 - not every backend can abort: destroy it instead
                log.debug("ProcessGroup.abort: %s", e)
        weight_group.destroy_weight_group(group)

    # ---- verify, commit ---------------------------------------------------------------------------------

    def probe_each(self, txn: SyncTransaction, token_ids, routes: bool = False) -> Dict[int, Any]:
        """Engine ``i``'s probe log-probs (``routes``: with its routing) for every alive engine; an engine that
        cannot score it is failed at ``verify``."""
        tokens = list(token_ids)
        fn = (lambda c: c.prompt_logprobs_and_routes(tokens)) if routes else (lambda c: c.prompt_logprobs(tokens))
        with txn.phase("verify"):
            return self._on_alive(txn, "verify", fn)

    def commit_weights(self, txn: SyncTransaction) -> List[int]:
        """``/update_weight_version`` on the engines still alive (verified); returns those that flipped."""
        with txn.phase("commit"):
            done = self._on_alive(txn, "commit", lambda c: c.update_weight_version(txn.version))
        committed = sorted(done)
        txn.committed(committed)
        if committed:
            self.weight_version = txn.version
        return committed
