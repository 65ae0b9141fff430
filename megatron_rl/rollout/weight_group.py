"""The process group that carries weights from the trainer to rollout engines (SGLang's
``/init_weights_update_group`` + ``/update_weights_from_distributed`` protocol).

Trainer rank 0 is rank 0 of a *separate* group (not the default ``torch.distributed`` world, which the
engines are not part of): it hosts a ``TCPStore`` at ``master_address:master_port`` and each engine
rank joins as ``rank_offset + tp_rank``. Tensors then go out one ``broadcast`` from rank 0 each, in the
order of the ``names`` list both sides agree on. ``gloo`` works on CPU; ``nccl`` on GPUs.

The group is built directly from a store (``ProcessGroupGloo(store, rank, size)``) rather than through
``dist.new_group``, which would require every process of the default world to take part. Hence the
raw ``ProcessGroup.broadcast`` calls below instead of ``dist.broadcast``.
"""

from __future__ import annotations

import datetime
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


def host_store(master_address: str, world_size: int, timeout_s: float = 300.0) -> dist.TCPStore:
    """Rank 0's store on a port the OS picks and the store holds (``.port``): no race with other
    processes for a port probed as free and bound later."""
    return dist.TCPStore(master_address, 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def create_weight_group(master_address: str, master_port: int, rank: int, world_size: int,
                        backend: str = "gloo", group_name: str = "weight_sync",
                        timeout_s: float = 300.0, store: Optional[dist.TCPStore] = None) -> dist.ProcessGroup:
    """Join (rank > 0) or host (rank 0) the weight-sync group; blocks until all ``world_size`` ranks arrive.
    Rank 0 may pass the ``store`` it already hosts (:func:`host_store`)."""
    if not (0 <= rank < world_size):
        raise ValueError(f"rank={rank} outside world_size={world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(master_address, int(master_port), world_size, is_master=(rank == 0), timeout=timeout)
    store = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    raise ValueError(f"backend={backend!r}: expected 'gloo' (CPU) or 'nccl' (GPU)")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} (expected e.g. 'bfloat16', 'float32')")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def broadcast_bucket(group: dist.ProcessGroup, bucket: Sequence[Tuple[str, torch.Tensor]]) -> None:
    """Trainer side (rank 0): send every tensor of the bucket, in order."""
    for _, tensor in bucket:
        group.broadcast(tensor.detach().contiguous(), 0).wait()


def receive_bucket(group: dist.ProcessGroup, names: Sequence[str], dtypes: Sequence[str],
                   shapes: Sequence[Sequence[int]], device: str = "cpu") -> List[Tuple[str, torch.Tensor]]:
    """Engine side: receive the tensors announced by ``names``/``dtypes``/``shapes``, in order."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
    out = []
    for name, dt, shape in zip(names, dtypes, shapes):
        t = torch.empty(tuple(int(s) for s in shape), dtype=dtype_from_name(dt), device=device)
        group.broadcast(t, 0).wait()
        out.append((name, t))
    return out


def bucket_metadata(bucket: Iterable[Tuple[str, torch.Tensor]]) -> dict:
    """The ``names``/``dtypes``/``shapes`` fields of ``/update_weights_from_distributed``."""
    names, dtypes, shapes = [], [], []
    for name, t in bucket:
        names.append(name)
        dtypes.append(dtype_name(t.dtype))
        shapes.append(list(t.shape))
    return dict(names=names, dtypes=dtypes, shapes=shapes)
