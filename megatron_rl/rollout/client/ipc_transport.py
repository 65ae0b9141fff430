"""Colocated weight sync: each trainer rank hands its own copy of a bucket, by handle, to the engine TP
rank on its GPU (``rollout.weight_transport: ipc``).

In colocated placement, engine ``e``'s TP rank ``i`` shares a GPU with trainer rank ``offset_e + i``
(``offset_e``: the TP sizes of the engines before it; ranks past the last engine host none). SGLang TP
rank ``i`` reads entry ``i`` of ``/update_weights_from_tensor``'s ``serialized_named_tensors`` and wants a
tensor on its own GPU (``tensor_payload.py``), so for each bucket:

1. every rank of engine ``e``'s group copies the bucket into a fresh buffer on its device and encodes it
   (:func:`~megatron_rl.weights.tensor_payload.encode_bucket`: a CUDA-IPC handle with the device's UUID;
   on CPU a shared-memory file);
2. the payloads are gathered (``gather_object`` over a gloo group of the engine's ranks) to the group's
   first rank, the *leader*, which posts them to its engine;
3. the leader shares the answer with its group (``broadcast_object_list``); only then do the ranks drop
   their buffers. A refusal raises on every rank of the group, with the server's message.

The leader opens the engine's weight-update session before the first bucket and closes it after the last
(also after a failure), then flushes the cache once and sets the version -- the same calls as
``RemoteEngine.update_weights``. Engine groups do not wait on each other. Collective: construct the
transport, and call :meth:`IpcTransport.update_weights`, on every trainer rank (``WeightSync`` does).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.rollout.client.http_client import RetryPolicy, SGLangClient
from megatron_rl.weights import tensor_payload
from megatron_rl.weights.receiver import NamedTensorBucket

log = logging.getLogger(__name__)


class IpcTransportError(RuntimeError):
    """The engine (or a rank of its group) failed a step of the sync; raised on every rank of the group."""


def engine_rank_groups(tp_sizes: Sequence[int], world_size: int) -> List[List[int]]:
    """The trainer ranks beside each engine's TP ranks: engine ``e`` -> ``[offset_e, offset_e + tp_e)``."""
    total = sum(tp_sizes)
    if total > world_size:
        raise ValueError(f"colocated engines with TP sizes {list(tp_sizes)} need {total} GPUs shared with trainer "
                         f"ranks, but there are {world_size} trainer ranks: lower rollout.num_engines or "
                         "rollout.sglang.tp_size, or use placement=disaggregated")
    offsets = [sum(tp_sizes[:e]) for e in range(len(tp_sizes))]
    return [list(range(o, o + tp)) for o, tp in zip(offsets, tp_sizes)]


class IpcTransport:
    """Weight buckets to colocated servers in SGLang's ``/update_weights_from_tensor`` format (module doc).

    ``urls``: the servers in engine order (the same list on every rank). Each server's TP size comes from
    its ``/server_info`` (read by rank 0, shared with all). ``load_format``: ``"flattened_bucket"`` (one
    buffer + metadata per bucket, as slime sends) or None (named views of the buffer).
    """

    def __init__(self, urls: Sequence[str], *, load_format: Optional[str] = tensor_payload.FLATTENED,
                 timeout_s: float = 600.0, retry: Optional[RetryPolicy] = None):
        if load_format not in tensor_payload.LOAD_FORMATS:
            raise ValueError(f"load_format={load_format!r}: expected one of {tensor_payload.LOAD_FORMATS}")
        self.load_format = load_format
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.tp_sizes = _server_tp_sizes(urls, timeout_s, retry)
        self.ranks: Optional[List[int]] = None  # this rank's engine group
        self.group = None
        self.client: Optional[SGLangClient] = None
        for url, ranks in zip(urls, engine_rank_groups(self.tp_sizes, world)):
            group = dist.new_group(ranks, backend="gloo") if len(ranks) > 1 else None  # collective: every rank
            if self.rank in ranks:
                self.ranks, self.group = ranks, group
                if self.rank == ranks[0]:
                    self.client = SGLangClient(url, timeout_s=timeout_s, retry=retry)

    @property
    def is_leader(self) -> bool:
        return self.client is not None

    # ---- one sync ------------------------------------------------------------------------------------

    def update_weights(self, named_tensor_buckets: Iterable[NamedTensorBucket], version: Any) -> None:
        """Send every bucket (pulled one at a time: producing one may be collective) as ``version``."""
        if self.ranks is None:  # no engine on this rank's GPU: take part in producing the buckets only
            for _ in named_tensor_buckets:
                pass
            return
        self._shared(lambda c: c.begin_weight_update(), "opening the weight-update session")
        try:
            for k, bucket in enumerate(named_tensor_buckets):
                self._send(list(bucket), k)
        except BaseException:
            if self.is_leader:
                try:
                    self.client.end_weight_update()
                except Exception as e:  # noqa: BLE001 - keep the original error
                    log.warning("%s: closing the weight-update session after a failure: %s", self.client.url, e)
            raise
        self._shared(lambda c: (c.end_weight_update(), c.flush_cache(), c.update_weight_version(str(version))),
                     f"finishing the update to version {version}")

    def _send(self, bucket: List, k: int) -> None:
        payload, error = None, None
        try:
            payload = tensor_payload.encode_bucket(bucket, self.load_format)
        except Exception as e:  # noqa: BLE001 - reported through the gather, so the leader does not post
            error = f"rank {self.rank} could not encode bucket {k}: {type(e).__name__}: {e}"
        mine = (None if payload is None else payload.text, error)
        if self.group is None:
            gathered = [mine]
        else:
            gathered = [None] * len(self.ranks) if self.is_leader else None
            dist.gather_object(mine, gathered, dst=self.ranks[0], group=self.group)
        try:
            def post(client: SGLangClient) -> None:
                failed = [e for _, e in gathered if e is not None]
                if failed:
                    raise IpcTransportError("; ".join(failed))
                client.update_weights_from_payloads([text for text, _ in gathered], self.load_format)

            self._shared(post, f"bucket {k} ({len(bucket)} tensors)")
        finally:
            del payload  # the server answered (or never will): the buffer may go
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.ipc_collect()  # blocks whose receiver let go

    def _shared(self, step: Callable[[SGLangClient], Any], what: str) -> None:
        """The leader runs ``step`` on its engine; every rank of the group learns the outcome, and raises if
        it failed (the leader its own exception, the others an :class:`IpcTransportError`)."""
        error, message = None, None
        if self.is_leader:
            try:
                step(self.client)
            except Exception as e:  # noqa: BLE001 - shared below, then re-raised
                error, message = e, f"{self.client.url} failed {what}: {type(e).__name__}: {e}"
        if self.group is not None:
            box = [message]
            dist.broadcast_object_list(box, src=self.ranks[0], group=self.group)
            message = box[0]
        if error is not None:
            raise error
        if message is not None:
            raise IpcTransportError(message)


def _server_tp_sizes(urls: Sequence[str], timeout_s: float, retry: Optional[RetryPolicy]) -> List[int]:
    """Each server's TP size from its ``/server_info``, read by rank 0 and broadcast (one answer for all)."""
    box: List[Any] = [None]
    if dist.get_rank() == 0:
        try:
            infos = [SGLangClient(u, timeout_s=timeout_s, retry=retry).server_info() for u in urls]
            box[0] = [int(i.get("tp_size", 1)) for i in infos]
            for u, i in zip(urls, infos):
                if int(i.get("pp_size") or 1) > 1 or int(i.get("dp_size") or 1) > 1:
                    box[0] = (f"weight_transport='ipc' supports servers with tensor parallelism only; {u} reports "
                              f"pp_size={i.get('pp_size')}, dp_size={i.get('dp_size')}")
        except Exception as e:  # noqa: BLE001 - every rank must learn it, not wait
            box[0] = f"reading /server_info of the colocated servers failed: {type(e).__name__}: {e}"
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise IpcTransportError(box[0])
    return box[0]
