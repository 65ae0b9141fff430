"""SGLang's ``/update_weights_from_tensor`` payload: tensors shared by handle, one payload per engine TP rank.

What SGLang 0.5.23 expects (``srt/managers/tp_worker.py deserialize_own_rank``,
``srt/model_executor/model_runner_components/weight_updater.py``): ``serialized_named_tensors`` is a list
with one entry per SGLang TP rank; TP rank ``i`` unpickles entry ``i`` (base64 of a
``MultiprocessingSerializer`` -- ``ForkingPickler`` -- dump, read back through its ``SafeUnpickler``) and
gets ``[(hf_name, tensor), ...]`` (``load_format`` None), which it moves to its device and feeds to
``model.load_weights``. The tensors are not copied into the payload: ``ForkingPickler`` shares them by
handle -- CUDA IPC handles for GPU tensors (rank ``i``'s entry should hold a copy on rank ``i``'s own GPU,
which in colocated placement is the trainer rank's GPU), shared-memory files for CPU tensors. So the
producer must keep every tensor alive until the call has returned.

* CUDA: the device travels as its UUID, not its index (SGLang's ``monkey_patch_torch_reductions``): two
  processes with different ``CUDA_VISIBLE_DEVICES`` number the same GPU differently.
* CPU: torch's default sharing strategy passes file descriptors over a socket only a forked child (same
  ``authkey``) can open; an unrelated process needs the ``file_system`` strategy (named shared-memory
  files), set around the dump.

:func:`decode_payloads` is the receiving side (what the embedded server does when a client speaks
SGLang's format): a restricted unpickler admitting only torch's tensor and storage rebuild functions,
as SGLang's ``SafeUnpickler`` does.
"""

from __future__ import annotations

import base64
import contextlib
import io
import pickle
from typing import List, Optional, Sequence, Tuple

import torch

_ALLOWED = {
    ("builtins", "list"), ("builtins", "tuple"), ("builtins", "dict"), ("builtins", "str"), ("builtins", "int"),
    ("collections", "OrderedDict"), ("torch", "Size"), ("torch", "device"), ("torch", "Tensor"),
    ("torch.nn.parameter", "Parameter"), ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
    ("torch", "UntypedStorage"), ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"), ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage_child"),
}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


@contextlib.contextmanager
def _file_system_sharing():
    import torch.multiprocessing as tmp

    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        tmp.set_sharing_strategy(before)


def _reduce_cuda_by_uuid(tensor: torch.Tensor):
    """``torch.multiprocessing.reductions.reduce_tensor`` with the device index replaced by its UUID
    (argument 6 of ``rebuild_cuda_tensor``), as SGLang's patched reducer sends it."""
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor:
        args = (*args[:6], str(torch.cuda.get_device_properties(args[6]).uuid), *args[7:])
    return rebuild, args


def serialize_named_tensors(named: Sequence[Tuple[str, torch.Tensor]]) -> str:
    """One TP rank's payload: base64 of a ``ForkingPickler`` dump of ``[(name, tensor), ...]``. Keep the
    tensors alive until the server has answered."""
    from multiprocessing.reduction import ForkingPickler

    items = [(name, t.detach()) for name, t in named]
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    if any(t.is_cuda for _, t in items):
        pickler.dispatch_table = dict(ForkingPickler._extra_reducers)
        pickler.dispatch_table[torch.Tensor] = _reduce_cuda_by_uuid
        pickler.dispatch_table[torch.nn.Parameter] = _reduce_cuda_by_uuid
    with _file_system_sharing():
        pickler.dump(items)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_payloads(payloads: Sequence[str], load_format: Optional[str], tp_rank: int = 0
                    ) -> List[Tuple[str, torch.Tensor]]:
    """What SGLang TP rank ``tp_rank`` loads from ``serialized_named_tensors`` (CPU tensors only here)."""
    if load_format not in (None, "direct"):
        raise ValueError(f"load_format={load_format!r}: this server decodes SGLang's plain named-tensor payloads "
                         "(load_format null or 'direct') only")
    if not 0 <= tp_rank < len(payloads):
        raise ValueError(f"{len(payloads)} payloads for TP rank {tp_rank}: expected one per engine TP rank")
    named = _SafeUnpickler(io.BytesIO(base64.b64decode(payloads[tp_rank], validate=True))).load()
    if not isinstance(named, list) or not all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)
                                              and isinstance(x[1], torch.Tensor) for x in named):
        raise ValueError("expected a pickled list of (name, tensor) pairs")
    return [(name, t.to("cpu").clone()) for name, t in named]  # the shared storage belongs to the producer
