"""A CPU-side placement guard: a CPU run that fails where a CUDA run would, on device placement.

On CPU every tensor already sits where the model is, so a tensor that was never moved to the device
(or created without ``device=``) passes every CPU test and dies at the first step on a GPU. Inside
:class:`DeviceGuard` tensors carry a tag:

* ``device``: the model's parameters, buffers and ``main_grad`` views (:meth:`DeviceGuard.place`), what
  ``.to(dev)`` / ``.cuda()`` / a factory with ``device=dev`` make, and every op output with a device input.
  ``dev`` is the guard's stand-in device ``cpu:0`` (still the CPU, so everything computes); the guard
  makes ``megatron_rl.parallel.device()`` and ``torch.cuda.current_device()`` return it and a device tensor's ``.device`` report it, so code
  that names its device the usual ways (``parallel.device()``, ``x.device``, ``p.device``) gets it.
* ``host``: factories without ``device=`` (or with ``cpu``), ``.cpu()`` / ``.to("cpu")``, tensors marked
  with :meth:`DeviceGuard.host` (a batch the driver built), and op outputs whose inputs are host only.
* untagged: everything else (tensors from before the guard, autograd's own): never an error.

An op that mixes a device tensor with a host tensor of one or more dimensions raises (CUDA's rule: a
0-dim CPU tensor is allowed as a scalar). Copies (``copy_``) and index tensors of ``[]`` may be on the
host, as on CUDA. Only Python-level torch calls are seen (a TorchFunctionMode): what autograd and the
optimizers do in C++ is not checked, and it is not where placement bugs live.

    with DeviceGuard() as guard:
        guard.place(trainer.module)     # or built inside: see place()
        trainer.train_step(batch)       # raises PlacementError on a host tensor meeting a device one

Test support only: the package never imports it.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

DEVICE = torch.device("cpu", 0)  # the guard's "device": the CPU, told apart by its index
_ORIGINAL_DEVICE = torch._C.TensorBase.device
_TAG = "_placement_guard"
_NO_CHECK = {torch.Tensor.copy_, torch.Tensor.__getitem__, torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda,
             torch.Tensor.detach, torch.Tensor.requires_grad_, torch.Tensor.__repr__, torch.Tensor.__format__,
             torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy}


class PlacementError(RuntimeError):
    """A host tensor met a device tensor in one op (a CUDA run raises here)."""


def _tag(t) -> Any:
    return getattr(t, _TAG, None) if isinstance(t, torch.Tensor) else None


def _set(tensors: Iterable, tag: str) -> None:
    for t in tensors:
        if isinstance(t, torch.Tensor):
            try:
                setattr(t, _TAG, tag)
            except (AttributeError, RuntimeError):  # tensors without a __dict__ (rare): stay untagged
                pass


def _device_property(self):
    if getattr(self, _TAG, None) == "device":
        return DEVICE
    if type(self) in (torch.Tensor, torch.nn.Parameter):
        return _ORIGINAL_DEVICE.__get__(self)
    # subclasses with their own __torch_function__ (ShardedTensor) key their handlers on the original getter
    patched = torch.Tensor.__dict__["device"]
    del torch.Tensor.device
    try:
        return self.device
    finally:
        torch.Tensor.device = patched


def _names_device(d) -> bool:
    if isinstance(d, torch.Tensor):
        return _tag(d) == "device"
    if isinstance(d, (str, int)) and not isinstance(d, bool):
        d = torch.device(d) if isinstance(d, str) else torch.device("cuda", d)
    return isinstance(d, torch.device) and (d.type == "cuda" or (d.type == "cpu" and d.index is not None))


def _names_host(d) -> bool:
    if isinstance(d, torch.Tensor):
        return _tag(d) == "host"
    if isinstance(d, str):
        d = torch.device(d)
    return isinstance(d, torch.device) and d.type == "cpu" and d.index is None


def _fmt(t: torch.Tensor) -> str:
    return f"{_tag(t) or 'untagged'} {tuple(t.shape)} {t.dtype}"


class DeviceGuard(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self._patched = []

    # -- marking --------------------------------------------------------------------------------------
    def place(self, *objs) -> None:
        """Tag as device tensors: modules' parameters, buffers, ``main_grad`` views and tensor attributes;
        optimizers' (torch, Megatron) parameters (the main fp32 copies) and state; loose tensors."""
        for obj in objs:
            inner = getattr(obj, "chained_optimizers", None) or [obj]
            if any(hasattr(o, "optimizer") or hasattr(o, "param_groups") for o in inner) and \
                    not isinstance(obj, torch.nn.Module):  # Megatron's / torch's optimizers: params + state
                for o in inner:
                    o = getattr(o, "optimizer", o)
                    _set([p for g in o.param_groups for p in g["params"]], "device")
                    _set([v for st in o.state.values() for v in st.values()], "device")
            elif isinstance(obj, torch.nn.Module):
                tensors = list(obj.parameters()) + list(obj.buffers())
                tensors += [p.main_grad for p in obj.parameters() if getattr(p, "main_grad", None) is not None]
                # plain tensor attributes (RoPE's inv_freq): Megatron makes them on the current CUDA device
                tensors += [v for m in obj.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
                _set(tensors, "device")
            else:
                _set(tree_flatten(obj)[0], "device")

    def host(self, *objs) -> None:
        """Tag tensors (anything ``vars()`` or a pytree reaches) as host tensors."""
        for obj in objs:
            leaves = tree_flatten(vars(obj) if hasattr(obj, "__dict__") and not isinstance(obj, torch.Tensor)
                                  else obj)[0]
            _set(leaves, "host")

    def place_trainer(self, trainer) -> None:
        """A ``PolicyTrainer``'s model, optimizer and reference model, as a trainer built on CUDA has them."""
        self.place(trainer.module)
        if trainer.optimizer is not None:
            self.place(trainer.optimizer)
        if getattr(trainer, "ref", None) is not None:
            self.place(trainer.ref.module)

    @staticmethod
    def is_device(t) -> bool:
        return _tag(t) == "device"

    @staticmethod
    def is_host(t) -> bool:
        return _tag(t) == "host"

    # -- the mode ---------------------------------------------------------------------------------------
    def __enter__(self):
        from megatron_rl import parallel

        self._patched = [(torch.Tensor, "device", torch.Tensor.__dict__.get("device")),
                         (parallel, "device", parallel.device),
                         (torch.cuda, "current_device", torch.cuda.current_device)]
        torch.Tensor.device = property(_device_property)
        parallel.device = lambda: DEVICE
        torch.cuda.current_device = lambda: DEVICE  # where Megatron allocates (RoPE, buffers): megatron_rl/compat/
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        for owner, name, old in reversed(self._patched):
            if old is None:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        self._patched = []
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:  # no CUDA here: a copy that is a device tensor
            out = args[0].clone()
            _set([out], "device")
            return out
        if func is torch.Tensor.to:
            return self._to(args, kwargs)
        if func is torch.Tensor.type or getattr(func, "__name__", "") in ("type", "_cuda_type_names"):
            # megatron_rl/compat/ swaps Tensor.type for a query that calls the real one: answer with the real one
            return torch._C.TensorBase.type(*args, **kwargs)
        out = func(*args, **kwargs)
        if func is torch.Tensor.cpu or func in (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy):
            _set(tree_flatten(out)[0], "host")
            return out
        name = getattr(func, "__name__", "")
        if name == "__get__" or func is torch.Tensor.copy_:  # properties (shape, grad, ...); copies
            if name == "__get__" and _tag(args[0]) and isinstance(out, torch.Tensor) and out is not args[0]:
                _set([out], _tag(args[0]))
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func is torch.Tensor.__setitem__:
            inputs = [args[0]] + [t for t in tree_flatten(args[2:])[0] if isinstance(t, torch.Tensor)]
        elif func in (torch.Tensor.__getitem__, torch.Tensor.index_put_, torch.Tensor.index_put):
            inputs = [args[0]] + ([args[2]] if len(args) > 2 and isinstance(args[2], torch.Tensor) else [])
        tags = [_tag(t) for t in inputs]
        if func not in _NO_CHECK and "device" in tags:
            bad = [t for t, g in zip(inputs, tags) if g == "host" and t.dim() > 0]
            if bad:
                raise PlacementError(
                    f"{getattr(func, '__qualname__', func)} mixes a device tensor with host tensor(s) "
                    f"{[_fmt(t) for t in bad]} (inputs: {[_fmt(t) for t in inputs]}); on CUDA this is "
                    "'Expected all tensors to be on the same device': move them with .to(device) or create "
                    "them with device=")
        if "device" in tags:
            _set(tree_flatten(out)[0], "device")
        elif "host" in tags:
            _set(tree_flatten(out)[0], "host")
        elif not inputs:  # a factory
            dev = kwargs.get("device")
            gen = kwargs.get("generator")
            if _names_device(dev) or (dev is None and gen is not None and _names_device(gen.device)):
                _set(tree_flatten(out)[0], "device")
            elif dev is None or _names_host(dev):
                _set(tree_flatten(out)[0], "host")
        return out

    def _to(self, args, kwargs):
        self_t = args[0]
        target = kwargs.get("device")
        for a in args[1:]:
            if isinstance(a, (torch.device, str, int, torch.Tensor)) and not isinstance(a, bool):
                target = a
        out = torch.Tensor.to(*args, **kwargs)
        if target is not None and _names_device(target):
            if out is self_t:  # already "there" on the CPU: a real move makes a new tensor
                out = self_t.clone()
            _set([out], "device")
        elif target is not None and _names_host(target):
            if out is self_t and _tag(self_t) == "device":
                out = self_t.clone()
            _set([out], "host")
        elif _tag(self_t):
            _set([out], _tag(self_t))
        return out
