"""The patch registry of the CPU compatibility layer (:mod:`megatron_rl.compat`): :func:`_patch` registers a
workaround with its reason and removal condition, :func:`apply` runs them once; and the narrow patching tools
the patch modules share."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List

import torch


@dataclass(frozen=True)
class Patch:
    name: str
    reason: str
    remove_when: str
    fn: Callable[[], None]


PATCHES: List[Patch] = []
_applied: List[str] = []
_done = False


def _patch(reason: str, remove_when: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    def register(fn: Callable[[], None]) -> Callable[[], None]:
        PATCHES.append(Patch(fn.__name__.lstrip("_"), reason, remove_when, fn))
        return fn

    return register


def apply() -> None:
    """Neutralise Megatron-Core's CUDA assumptions when CUDA is absent. Idempotent; no-op with CUDA."""
    global _done
    if _done or torch.cuda.is_available():
        return
    for p in PATCHES:
        p.fn()
        _applied.append(p.name)
    _done = True


def is_applied() -> bool:
    return _done


def applied_patches() -> List[str]:
    """``"name: reason (remove when ...)"`` for every patch applied in this process."""
    by_name = {p.name: p for p in PATCHES}
    return [f"{n}: {by_name[n].reason} (remove when {by_name[n].remove_when})" for n in _applied]


# ---------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------

_CPU = torch.device("cpu")


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _cpu_device_kwarg(factory: Callable) -> Callable:
    @functools.wraps(factory)
    def wrapped(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        return factory(*args, **kwargs)

    return wrapped


class _CpuFactoryTorch:
    """The ``torch`` name as one Megatron module sees it: tensor factories asked for ``device="cuda"``
    allocate on the CPU instead; every other attribute is the real ``torch``."""

    _FACTORIES = frozenset({"zeros", "ones", "empty", "full", "tensor", "arange"})

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        return _cpu_device_kwarg(attr) if name in self._FACTORIES else attr


def _shim_torch_in(module_name: str) -> None:
    module = importlib.import_module(module_name)
    if not isinstance(module.torch, _CpuFactoryTorch):
        module.torch = _CpuFactoryTorch(module.torch)


@contextlib.contextmanager
def _swapped(owner: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def _during(owner: Any, method: str, context: Callable[[], contextlib.AbstractContextManager]) -> None:
    """Wrap ``owner.method`` so that it runs inside ``context()``."""
    original = getattr(owner, method)
    if getattr(original, "_megatron_rl_compat", False):
        return

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        with context():
            return original(*args, **kwargs)

    wrapped._megatron_rl_compat = True
    setattr(owner, method, wrapped)


_real_tensor_type = torch.Tensor.type


def _cuda_type_names(self: torch.Tensor, *args, **kwargs):
    # Only the no-argument form (a type *query*) is rewritten; conversions pass through.
    name = _real_tensor_type(self, *args, **kwargs)
    if not args and not kwargs and isinstance(name, str) and name.startswith("torch.") and not self.is_cuda:
        return "torch.cuda." + name[len("torch.") :]
    return name


def _cuda_type_queries() -> contextlib.AbstractContextManager:
    return _swapped(torch.Tensor, "type", _cuda_type_names)


def _tensor_cuda_is_identity() -> contextlib.AbstractContextManager:
    return _swapped(torch.Tensor, "cuda", lambda self, *a, **k: self)


# ---------------------------------------------------------------------------------------------------
# Patches (applied in this order)
# ---------------------------------------------------------------------------------------------------
