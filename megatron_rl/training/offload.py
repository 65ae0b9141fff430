"""Trainer offload for colocated placement: while the rollout engines run on the trainer's GPUs, the
optimizer state and the gradient buffers live in host memory; the parameters stay (the weight sync and
the probe check read them).

* Gradient buffers: Megatron's own ``DistributedDataParallel.offload_grad_buffers`` /
  ``restore_grad_buffers`` (megatron-core >= 0.14): each buffer's storage is resized to 0 and reallocated
  (zeroed) later, so every view -- ``param.main_grad``, bucket views -- stays valid. Nothing to copy:
  a train step starts by zeroing them anyway.
* Optimizer state: megatron-core 0.16.1's ``MegatronOptimizer.offload_to_cpu`` rebinds ``p.data`` to new
  CPU tensors and back with ``.cuda()``: that cuts the aliasing the distributed optimizer relies on (its
  fp32 main shards are views of the model parameters' buffer: ``distrib_optimizer.py`` ~421), moves those
  parameters' data too, and needs CUDA. So here each distinct *storage* of the optimizer (Adam moments,
  fp32 master copies of bf16 parameters; never storage shared with the model's parameters or their
  buffers) is copied to pinned host memory (kept across steps, so pinning is paid once) and resized to 0,
  then resized back and copied in: every tensor object, view and ``optimizer.state`` key stays as it was,
  so the next step is bitwise the step an un-offloaded trainer takes.

No LD_PRELOAD, no allocator hooks. :func:`memory_snapshot` reports what is resident (GPU: allocated,
reserved, the device's total in use -- which includes a colocated engine's memory; CPU: this process's RSS).
"""

from __future__ import annotations

import logging
from typing import Dict, List

import torch

log = logging.getLogger(__name__)

GiB = float(1 << 30)


def memory_snapshot(prefix: str) -> Dict[str, float]:
    """``{prefix}gpu_allocated_gib``, ``gpu_reserved_gib``, ``gpu_peak_allocated_gib`` (since the last
    :func:`reset_peak`), ``gpu_device_used_gib`` (every process on the device) -- with CUDA -- and
    ``cpu_rss_gib``."""
    import psutil

    out = {"cpu_rss_gib": psutil.Process().memory_info().rss / GiB}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        free, total = torch.cuda.mem_get_info()
        out.update(gpu_allocated_gib=torch.cuda.memory_allocated() / GiB,
                   gpu_reserved_gib=torch.cuda.memory_reserved() / GiB,
                   gpu_peak_allocated_gib=torch.cuda.max_memory_allocated() / GiB,
                   gpu_device_used_gib=(total - free) / GiB)
    return {prefix + k: v for k, v in out.items()}


def reset_peak() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


class _HostCopy:
    """One storage moved out (resized to 0) and back, through a host buffer kept for the next round."""

    def __init__(self, storage: torch.UntypedStorage):
        self.storage, self.nbytes = storage, storage.nbytes()
        self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=storage.is_cuda).untyped_storage()

    def offload(self) -> None:
        self.host.copy_(self.storage, non_blocking=True)

    def reload(self) -> None:
        self.storage.resize_(self.nbytes)
        self.storage.copy_(self.host, non_blocking=True)


class TrainerOffload:
    """``offload()`` / ``reload()`` of a trainer's optimizer state and DDP gradient buffers (module doc).

    Must not be offloaded during a train step or a checkpoint save (both read the state); the trainer
    raises if asked to. Call ``offload`` on every rank (no collectives inside, but every rank's memory).
    """

    def __init__(self, ddp, optimizer, module: torch.nn.Module):
        self.ddp, self.optimizer, self.module = ddp, optimizer, module
        self.device = next(module.parameters()).device
        self.offloaded = False
        self._copies: Dict[int, _HostCopy] = {}

    def _optimizer_storages(self) -> List[torch.UntypedStorage]:
        """Distinct storages of the optimizer's parameters and state on the trainer's device, except the
        model's own (parameters, and the DDP buffers they are views of)."""
        model = {p.untyped_storage().data_ptr() for p in self.module.parameters()}
        for buffer in getattr(self.ddp, "buffers", []) + getattr(self.ddp, "expert_parallel_buffers", []):
            if getattr(buffer, "param_data", None) is not None:
                model.add(buffer.param_data.untyped_storage().data_ptr())
        seen: Dict[int, torch.UntypedStorage] = {}
        for leaf in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(leaf, "optimizer", None)
            if inner is None or getattr(leaf, "is_stub_optimizer", False):
                continue
            tensors = [p for group in inner.param_groups for p in group["params"]]
            tensors += [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
            for t in tensors:
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if t.device == self.device and storage.nbytes() > 0 and ptr not in model:
                    seen.setdefault(ptr, storage)
        return list(seen.values())

    def offload(self) -> None:
        if self.offloaded:
            return
        cuda = self.device.type == "cuda"
        self.optimizer.zero_grad()  # master copies' .grad (bf16: fp32 copies of the grads) are rebuilt each step
        storages = self._optimizer_storages()
        copies = []
        for storage in storages:
            copy = self._copies.get(storage.data_ptr())
            if copy is None or copy.storage.nbytes() != storage.nbytes():
                copy = _HostCopy(storage)
            copy.offload()
            copies.append(copy)
        if cuda:
            torch.cuda.synchronize()  # the host copies are complete before their sources are freed
        for copy in copies:
            copy.storage.resize_(0)
        self._copies = {id(c): c for c in copies}  # data pointers are gone; keyed again on reload
        self.ddp.offload_grad_buffers(synchronize=cuda, empty_cache=cuda)
        self.offloaded = True

    def reload(self) -> None:
        if not self.offloaded:
            return
        cuda = self.device.type == "cuda"
        self.ddp.restore_grad_buffers(synchronize=False)
        for copy in self._copies.values():
            copy.reload()
        if cuda:
            torch.cuda.synchronize()
        self._copies = {c.storage.data_ptr(): c for c in self._copies.values()}
        self.offloaded = False
