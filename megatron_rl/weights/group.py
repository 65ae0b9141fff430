"""The process group that carries weights from the trainer to rollout engines (SGLang's
``/init_weights_update_group`` + ``/update_weights_from_distributed`` protocol).

Trainer rank 0 is rank 0 of a *separate* group (not the default ``torch.distributed`` world, which the
engines are not part of): it hosts a ``TCPStore`` at ``master_address:master_port`` and engine rank
``rank_offset + tp_rank`` of each server joins it. Every rank builds the group exactly as SGLang 0.5.23's
``sglang.srt.utils.common.init_custom_process_group`` does -- ``PrefixStore(group_name, store)``, then
``torch.distributed.distributed_c10d._new_process_group_helper`` (which prefixes ``group_name/`` and the
device again), then ``_world.pg_group_ranks[pg] = identity`` -- so both sides wait on the same store keys
(``/G/G//cpu//0/0`` for gloo). A group built any other way (``ProcessGroupGloo(PrefixStore(G, store))``
waits on ``/G/0/1``) never meets SGLang's ranks.

Tensors then go out from rank 0 in the order of the announced ``names``: one ``broadcast`` per tensor, or
one per bucket with ``load_format="flattened_bucket"`` (SGLang's ``FlattenedTensorBucket``: the bucket's
tensors as one ``uint8`` buffer, each at a byte offset aligned to its dtype). ``gloo`` works on CPU;
``nccl`` on GPUs.
"""

from __future__ import annotations

import datetime
import math
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

from megatron_rl.parallel import rendezvous_store

FLATTENED = "flattened_bucket"  # SGLang's load_format for one-buffer buckets


def host_store(master_address: str, world_size: int, timeout_s: float = 300.0, port: int = 0) -> dist.TCPStore:
    """Rank 0's store, listening on ``master_address`` only (a plain ``TCPStore`` listens on every interface:
    a local run's would be reachable from the network). ``port=0``: a port the OS picks and the store holds
    (``.port``), no race with other processes for a port probed as free and bound later."""
    return rendezvous_store(master_address, int(port), world_size, is_master=True, timeout_s=timeout_s)


def create_weight_group(master_address: str, master_port: int, rank: int, world_size: int,
                        backend: str = "gloo", group_name: str = "weight_update_group",
                        timeout_s: float = 300.0, store: Optional[dist.TCPStore] = None) -> dist.ProcessGroup:
    """Join (rank > 0) or host (rank 0) the weight-sync group; blocks until all ``world_size`` ranks arrive.
    Rank 0 may pass the ``store`` it already hosts (:func:`host_store`). A ``group_name`` can exist once per
    process: :func:`destroy_weight_group` it before re-creating it."""
    if not (0 <= rank < world_size):
        raise ValueError(f"rank={rank} outside world_size={world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: expected 'gloo' (CPU) or 'nccl' (GPU)")
    if not group_name:
        raise ValueError("group_name must not be empty (SGLang refuses it)")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None and rank == 0:
        store = host_store(master_address, world_size, timeout_s, port=master_port)
    elif store is None:
        # what torch's tcp:// rendezvous (SGLang's init_method) builds on a joining rank: a client of rank 0's
        store = dist.TCPStore(master_address, int(master_port), world_size, is_master=False, timeout=timeout,
                              multi_tenant=True)
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, backend_options=None, timeout=timeout,
                                         device_id=None)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_weight_group(group: Optional[dist.ProcessGroup]) -> None:
    """Forget ``group`` (its name becomes free again); a no-op for None."""
    if group is not None:
        dist.destroy_process_group(group)


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} (expected e.g. 'bfloat16', 'float32')")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def can_flatten(bucket: Sequence[Tuple[str, torch.Tensor]]) -> bool:
    """Whether SGLang's ``FlattenedTensorBucket.empty`` accepts the bucket's layout: every tensor's byte offset
    must be a multiple of its dtype's size (always true when the bucket has one dtype)."""
    offset = 0
    for _, t in bucket:
        if offset % t.element_size():
            return False
        offset += t.numel() * t.element_size()
    return bool(bucket)


def flatten(bucket: Sequence[Tuple[str, torch.Tensor]]) -> torch.Tensor:
    """The bucket as one contiguous ``uint8`` buffer in announce order (SGLang's ``FlattenedTensorBucket``)."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket])


def broadcast_bucket(group: dist.ProcessGroup, bucket: Sequence[Tuple[str, torch.Tensor]],
                     load_format: Optional[str] = None) -> None:
    """Trainer side (rank 0): send the bucket as announced (blocking)."""
    for work in broadcast_bucket_async(group, bucket, load_format):
        work.wait()


def broadcast_bucket_async(group: dist.ProcessGroup, bucket: Sequence[Tuple[str, torch.Tensor]],
                           load_format: Optional[str] = None) -> List[dist.Work]:
    """Trainer side (rank 0): start sending the bucket; the returned works complete when it is sent."""
    tensors = [flatten(bucket)] if load_format == FLATTENED else [t.detach().contiguous() for _, t in bucket]
    return [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]


def receive_bucket(group: dist.ProcessGroup, names: Sequence[str], dtypes: Sequence[str],
                   shapes: Sequence[Sequence[int]], device: str = "cpu",
                   load_format: Optional[str] = None) -> List[Tuple[str, torch.Tensor]]:
    """Engine side: receive the tensors announced by ``names``/``dtypes``/``shapes``, in order (what SGLang's
    ``receive_weights_from_distributed`` does, plain or ``flattened_bucket``)."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
    if load_format not in (None, FLATTENED):
        raise ValueError(f"load_format={load_format!r}: expected None or {FLATTENED!r}")
    specs = [(n, dtype_from_name(d), tuple(int(s) for s in shape)) for n, d, shape in zip(names, dtypes, shapes)]
    if load_format != FLATTENED:
        out = [(n, torch.empty(shape, dtype=dt, device=device)) for n, dt, shape in specs]
        for work in [dist.broadcast(t, src=0, group=group, async_op=True) for _, t in out]:
            work.wait()
        return out
    offsets, total = [], 0
    for n, dt, shape in specs:
        if total % dt.itemsize:
            raise ValueError(f"Unaligned received tensor {n}: byte offset {total}, dtype {dt}")
        offsets.append(total)
        total += math.prod(shape) * dt.itemsize
    if not specs:
        raise ValueError("Cannot create empty tensor bucket")
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=0, group=group)
    return [(n, buffer[o:o + math.prod(shape) * dt.itemsize].view(dt).reshape(shape))
            for (n, dt, shape), o in zip(specs, offsets)]


def bucket_metadata(bucket: Iterable[Tuple[str, torch.Tensor]]) -> dict:
    """The ``names``/``dtypes``/``shapes`` fields of ``/update_weights_from_distributed``."""
    names, dtypes, shapes = [], [], []
    for name, t in bucket:
        names.append(name)
        dtypes.append(dtype_name(t.dtype))
        shapes.append(list(t.shape))
    return dict(names=names, dtypes=dtypes, shapes=shapes)
