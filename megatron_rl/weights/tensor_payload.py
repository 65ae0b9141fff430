"""SGLang's ``/update_weights_from_tensor`` payload: tensors shared by handle, one payload per engine TP rank.

What SGLang 0.5.23 expects (``srt/managers/tp_worker.py deserialize_own_rank``,
``srt/model_executor/model_runner_components/weight_updater.py update_weights_from_tensor``):
``serialized_named_tensors`` is a list with one entry per SGLang TP rank; TP rank ``i`` unpickles entry
``i`` only (base64 of a ``MultiprocessingSerializer`` -- ``ForkingPickler`` -- dump, read back through its
``SafeUnpickler``, which admits torch's rebuild functions and a few SGLang data classes). Every entry holds
the *whole* bucket (each TP rank takes its own shard in ``load_weights``). The tensors are not copied into
the payload: ``ForkingPickler`` shares them by handle -- CUDA IPC handles for GPU tensors (rank ``i``'s
entry should hold a copy on rank ``i``'s own GPU, which in colocated placement is the GPU of the trainer
rank beside it), shared-memory files for CPU tensors. The producer must keep every tensor alive until
the call has returned. Two ``load_format`` values:

* ``None``: the entry is ``[(hf_name, tensor), ...]``; each tensor goes through ``_unwrap_tensor``
  (``.to(device)``) into ``model.load_weights``. We share views of one flat buffer, so a bucket is one
  IPC handle (the receiver opens a storage once, whatever the number of views).
* ``"flattened_bucket"`` (what slime sends): the entry is ``{"flattened_tensor": uint8 [N], "metadata":
  [m, ...]}``, each ``m`` read by attribute (``name, shape, dtype, start_idx, end_idx, numel``; byte
  offsets) into SGLang's ``FlattenedTensorMetadata`` (``_update_weights_from_flattened_bucket``), whose
  ``reconstruct_tensors`` takes ``flat[start_idx:end_idx].view(dtype).reshape(shape)`` -- so each offset
  must be a multiple of its dtype's size. SGLang's ``SafeUnpickler`` admits its own class or
  ``types.SimpleNamespace`` there; we send the latter (the producer needs no SGLang install) and the
  embedded server reads both.

* CUDA: the device travels as its UUID, not its index (SGLang's ``monkey_patch_torch_reductions``,
  ``srt/utils/patch_torch.py``): two processes with different ``CUDA_VISIBLE_DEVICES`` number the same GPU
  differently. SGLang patches ``reductions.rebuild_cuda_tensor`` before unpickling, so a payload naming
  torch's own ``rebuild_cuda_tensor`` with a UUID is read right.
* CPU: torch's default sharing strategy passes file descriptors over a socket only a forked child (same
  ``authkey``) can open; an unrelated process needs the ``file_system`` strategy (named shared-memory
  files), set around the dump.

:func:`decode_payloads` is the receiving side (what the embedded server does when a client speaks
SGLang's format): a restricted unpickler admitting what SGLang's ``SafeUnpickler`` admits for these
payloads.
"""

from __future__ import annotations

import base64
import contextlib
import io
import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.multiprocessing
import torch.multiprocessing as tmp
from torch.multiprocessing import reductions

FLATTENED = "flattened_bucket"
LOAD_FORMATS = (None, FLATTENED)


def flatten_bucket(named: Sequence[Tuple[str, torch.Tensor]], device: Optional[torch.device] = None
                   ) -> Tuple[torch.Tensor, List[SimpleNamespace]]:
    """A fresh ``uint8`` buffer holding a copy of every tensor (on ``device``, default the first tensor's),
    each at a byte offset aligned to its dtype (SGLang's producer packs them back to back; with one dtype per
    bucket the layouts are identical), and the metadata SGLang reads it with."""
    if not named:
        raise ValueError("cannot flatten an empty bucket (SGLang refuses it too)")
    metas, offset = [], 0
    for name, t in named:
        item = t.element_size()
        offset += -offset % item
        size = t.numel() * item
        metas.append(SimpleNamespace(name=name, shape=torch.Size(t.shape), dtype=t.dtype, start_idx=offset,
                                     end_idx=offset + size, numel=size))
        offset += size
    flat = torch.empty(offset, dtype=torch.uint8, device=device if device is not None else named[0][1].device)
    for (_, t), m in zip(named, metas):
        view_of(flat, m).copy_(t.detach())
    return flat, metas


def view_of(flat: torch.Tensor, meta: SimpleNamespace) -> torch.Tensor:
    """Tensor ``meta`` inside ``flat`` (what SGLang's ``FlattenedTensorBucket.reconstruct_tensors`` does)."""
    return flat[meta.start_idx:meta.end_idx].view(meta.dtype).reshape(meta.shape)


# ---- producer ---------------------------------------------------------------------------------------------


def _reduce_cuda_by_uuid(tensor: torch.Tensor):
    """``torch.multiprocessing.reductions.reduce_tensor`` with the device index replaced by its UUID
    (argument 6 of ``rebuild_cuda_tensor``), as SGLang's patched reducer sends it."""
    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor and isinstance(args[6], int):  # (not if SGLang patched torch here)
        args = (*args[:6], str(torch.cuda.get_device_properties(args[6]).uuid), *args[7:])
    return rebuild, args


@contextlib.contextmanager
def _file_system_sharing():
    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        tmp.set_sharing_strategy(before)


def _dump(obj: Any, cuda: bool) -> str:
    """base64 of ``MultiprocessingSerializer.serialize(obj)``: ``ForkingPickler``, CUDA devices by UUID."""
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    if cuda:
        pickler.dispatch_table[torch.Tensor] = _reduce_cuda_by_uuid
        pickler.dispatch_table[torch.nn.Parameter] = _reduce_cuda_by_uuid
    with _file_system_sharing():
        pickler.dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_named_tensors(named: Sequence[Tuple[str, torch.Tensor]]) -> str:
    """One TP rank's ``load_format=None`` payload: base64 of a ``ForkingPickler``-style dump of ``[(name,
    tensor), ...]``, the tensors shared as they are. Keep them alive until the server has answered."""
    items = [(name, t.detach()) for name, t in named]
    return _dump(items, any(t.is_cuda for _, t in items))


@dataclass
class Payload:
    """One TP rank's payload and the buffer it points into (keep ``keepalive`` until the server answered)."""

    text: str
    keepalive: torch.Tensor


def encode_bucket(named: Sequence[Tuple[str, torch.Tensor]], load_format: Optional[str] = FLATTENED,
                  device: Optional[torch.device] = None) -> Payload:
    """Copy ``named`` into one fresh buffer on ``device`` and encode it for ``/update_weights_from_tensor`` in
    ``load_format`` (``"flattened_bucket"``, or None: named views of the buffer). A fresh buffer per bucket:
    SGLang answers once its copies are *enqueued* on its GPU stream, so a reused buffer could be overwritten
    under them (slime learnt this too); torch keeps a shared CUDA block alive until the receiver let go."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r}: expected one of {LOAD_FORMATS}")
    flat, metas = flatten_bucket(named, device)
    if load_format == FLATTENED:
        text = _dump({"flattened_tensor": flat, "metadata": metas}, flat.is_cuda)
    else:
        text = serialize_named_tensors([(m.name, view_of(flat, m)) for m in metas])
    return Payload(text, flat)


def request_body(payloads: Sequence[str], load_format: Optional[str]) -> Dict[str, Any]:
    """The ``/update_weights_from_tensor`` body: one payload per TP rank; the cache is flushed once per sync."""
    return dict(serialized_named_tensors=list(payloads), load_format=load_format, flush_cache=False)


# ---- receiver (the embedded server) -----------------------------------------------------------------------


def _device_index(device: Any) -> int:
    if isinstance(device, int):
        return device
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == device:
            return i
    raise ValueError(f"no visible CUDA device has UUID {device} (CUDA_VISIBLE_DEVICES of this process)")


def _rebuild_cuda_tensor_by_uuid(*args):
    return reductions.rebuild_cuda_tensor(*args[:6], _device_index(args[6]), *args[7:])


_REDUCTIONS = "torch.multiprocessing.reductions"
_ALLOWED = {
    ("types", "SimpleNamespace"), ("builtins", "list"), ("builtins", "tuple"), ("builtins", "dict"),
    ("builtins", "str"), ("builtins", "int"), ("collections", "OrderedDict"), ("torch", "Size"), ("torch", "device"),
    ("torch", "Tensor"), ("torch.nn.parameter", "Parameter"), ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
    ("torch", "UntypedStorage"), ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"), (_REDUCTIONS, "rebuild_tensor"), (_REDUCTIONS, "rebuild_storage_filename"),
    (_REDUCTIONS, "rebuild_storage_empty"), (_REDUCTIONS, "rebuild_typed_storage"),
    (_REDUCTIONS, "rebuild_typed_storage_child"),
}
_MAPPED: Dict[Tuple[str, str], Callable] = {
    (_REDUCTIONS, "rebuild_cuda_tensor"): _rebuild_cuda_tensor_by_uuid,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor_by_uuid,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): SimpleNamespace,  # read by attribute
}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _MAPPED:
            return _MAPPED[(module, name)]
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def _load(payload: str) -> Any:
    return _SafeUnpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()


def decode_payload(payload: str, load_format: Optional[str]) -> List[Tuple[str, torch.Tensor]]:
    """One TP rank's entry -> ``[(name, tensor)]``, copied out of the producer's shared memory."""
    if load_format not in (None, "direct", FLATTENED):
        raise ValueError(f"load_format={load_format!r}: this server decodes SGLang's named-tensor payloads "
                         f"(load_format null, 'direct' or {FLATTENED!r}) only")
    obj = _load(payload)
    if load_format == FLATTENED:
        flat, metas = (obj.get("flattened_tensor"), obj.get("metadata")) if isinstance(obj, dict) else (None, None)
        fields = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")
        if not (isinstance(flat, torch.Tensor) and flat.dtype == torch.uint8 and isinstance(metas, list)
                and all(isinstance(m, SimpleNamespace) and all(hasattr(m, f) for f in fields) for m in metas)):
            raise ValueError("a flattened_bucket payload is {'flattened_tensor': uint8 tensor, 'metadata': [entries "
                             f"with {', '.join(fields)}]}}")
        named = [(m.name, view_of(flat, m)) for m in metas]
    else:
        named = obj
        if not isinstance(named, list) or not all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)
                                                  and isinstance(x[1], torch.Tensor) for x in named):
            raise ValueError("expected a pickled list of (name, tensor) pairs")
    return [(name, t.to("cpu").clone()) for name, t in named]  # the shared storage belongs to the producer


def decode_payloads(payloads: Sequence[str], load_format: Optional[str], tp_size: int = 1
                    ) -> List[Tuple[str, torch.Tensor]]:
    """What an SGLang server of ``tp_size`` ranks loads from ``serialized_named_tensors``: rank ``i`` reads entry
    ``i`` (so fewer entries than ranks fail; extra ones are never read). Every entry must carry the same
    bucket; returns rank 0's."""
    if len(payloads) < tp_size:
        raise ValueError(f"{len(payloads)} payload(s) for {tp_size} TP rank(s): TP rank {len(payloads)} has none "
                         "(list index out of range); send one per engine TP rank")
    buckets = [decode_payload(payloads[i], load_format) for i in range(tp_size)]
    first = buckets[0]
    for i, other in enumerate(buckets[1:], 1):
        if [n for n, _ in other] != [n for n, _ in first] or not all(
                a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(first, other)):
            raise ValueError(f"TP rank {i}'s payload differs from TP rank 0's: every rank must get the whole bucket")
    return first
