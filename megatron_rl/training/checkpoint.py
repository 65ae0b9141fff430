"""Trainer checkpoints with Megatron's ``dist_checkpointing`` (``torch_dist`` format): atomic, reshardable.

Layout of ``root``::

    iter_0000012/          one complete checkpoint (dist-checkpointing directory)
    iter_0000016/
    latest                 text file: the name of the newest complete checkpoint ("iter_0000016")
    .tmp_iter_0000020/     a save in progress (or a crashed one; removed by the next save)

Contents: model weights and optimizer state (sharded tensors; every rank writes its own shards),
the RNG states of every rank (a sharded object, restored only into the same layout), and in the common
part (written once): step, skipped-step counter, LR and LR-schedule state (the length-surge state
machine included), the parallel layout, the ``ModelConfig`` (``megatron-rl export`` rebuilds the model from
it), and the driver's opaque ``extra`` dict (sampler position...).

Atomicity: all ranks write into ``.tmp_iter_N``; every host fsyncs the files; rank 0 renames the
directory to ``iter_N`` and then atomically replaces ``latest`` (write ``latest.tmp``, fsync,
``os.replace``). A crash at any point before that leaves ``latest`` on the previous checkpoint.

Integrity (:mod:`.checkpoint_integrity`): a save first checks the free space it needs (a clear
``CheckpointSpaceError`` on every rank instead of a torn write), and writes a manifest of every file's
size and CRC-32 before the commit. A load checks the manifest (the ranks share the reading) and, when the
newest checkpoint is damaged, warns and falls back to the newest intact one (an explicit ``step`` is
never replaced). The common state records the model's shape, so resuming with another model size names
the differing fields instead of failing in a tensor copy.

Resharding (checked on CPU: tests/distributed/test_checkpoint.py and by hand):

* model weights are stored per parameter in model space: TP2 <-> PP2 <-> TP1/PP1 and, for MoE, EP2 <-> EP1
  all load;
* optimizer state: the plain Megatron optimizer, and the distributed optimizer in the default
  ``fully_reshardable`` format (gathered per parameter on DP rank 0 while saving), reshard over TP and
  PP (next-step losses within 4e-7 of the unresharded run). ``dp_reshardable`` (each rank writes its
  own flat buffer shard, no gather) reshards over DP only. Not across EP for MoE models (Megatron
  regroups the expert optimizer): load those with ``load_optimizer=False``. Both refusals are
  ValueErrors raised before anything is read;
* RNG states are restored only into the same layout;
* the padded vocabulary depends on TP (``vocab_divisor * tp``): layouts with different padded sizes
  cannot exchange the embedding.

Same layout, any format: resuming reproduces the next steps' losses bitwise (the Adam step counters
needed a fix-up after loading, see :func:`_restore_adam_steps`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import re
import shutil
import socket
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_rl.training import checkpoint_integrity as integrity
from megatron_rl.training.checkpoint_integrity import (
    CheckpointCorruptError, CheckpointMismatchError, CheckpointSpaceError,
)

logger = logging.getLogger(__name__)
FORMAT_VERSION = 1
_ITER_RE = re.compile(r"^iter_(\d{7})$")
# Megatron-Core 0.16.1 also lists 'fully_sharded_model_space', but it builds flattened ShardedTensors
# that the same release refuses ("ShardedTensor.flattened_range is not supported"): not offered.
_FORMATS = ("fully_reshardable", "dp_reshardable")


@dataclass(frozen=True)
class CheckpointConfig:
    """Attributes:
        root: directory holding ``iter_*`` checkpoints and the ``latest`` pointer.
        keep_last: number of newest checkpoints kept (older ones are deleted after a successful save);
            0 keeps all.
        save_optimizer: include optimizer state (without it a resumed run restarts Adam's moments).
        optimizer_format: distributed-optimizer state format (see the module docstring).
    """

    root: str
    keep_last: int = 3
    save_optimizer: bool = True
    optimizer_format: str = "fully_reshardable"

    def __post_init__(self) -> None:
        if not self.root:
            raise ValueError("checkpoint.root must be a directory path")
        if self.keep_last < 0:
            raise ValueError(f"checkpoint.keep_last={self.keep_last} must be >= 0 (0 keeps every checkpoint)")
        if self.optimizer_format not in _FORMATS:
            raise ValueError(f"checkpoint.optimizer_format={self.optimizer_format!r} is not one of {_FORMATS}")


def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


def latest_checkpoint(root: str) -> Optional[str]:
    """Path of the newest complete checkpoint under ``root`` (from the ``latest`` pointer), or None.
    Without the pointer (deleted, or a directory in its place): the newest ``iter_*`` holding its manifest
    (each is renamed into place complete; a damaged one is skipped for an older one when loaded)."""
    pointer = os.path.join(root, "latest")
    if not os.path.isfile(pointer):
        found = [s for s in list_checkpoints(root)
                 if os.path.isfile(os.path.join(root, iter_name(s), integrity.MANIFEST))]
        return os.path.join(root, iter_name(found[-1])) if found else None
    with open(pointer) as f:
        name = f.read().strip()
    if not _ITER_RE.match(name) or not os.path.isdir(os.path.join(root, name)):
        raise ValueError(f"{pointer} names {name!r}, which is not a checkpoint directory under {root}")
    return os.path.join(root, name)


def list_checkpoints(root: str) -> List[int]:
    """Steps of the complete checkpoints under ``root``, ascending."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in (_ITER_RE.match(n) for n in os.listdir(root)) if m)


# ---------------------------------------------------------------------------------------------------
# State
# ---------------------------------------------------------------------------------------------------


def _layout(trainer) -> Dict[str, Any]:
    lay = trainer.groups.layout
    return {"tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "cp": lay.cp, "etp": lay.etp, "world": dist.get_world_size()}


def _optimizer_metadata(cfg_format: str) -> Dict[str, Any]:
    return {
        "distrib_optim_sharding_type": cfg_format,
        "chained_optim_avoid_prefix": True,
        # 'fully_reshardable' gathers the state on DP rank 0; the default path moves it through CUDA
        # (``.cuda()``), the memory-efficient one through the gloo DP group: the one that works on CPU.
        "distrib_optim_fully_reshardable_mem_efficient": not torch.cuda.is_available(),
    }


def _rng_state() -> Dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }


def _set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_object(state: Optional[Dict[str, Any]]):
    # One object per global rank; loadable only by the same world (checked before loading).
    return ShardedObject("rng_state", state, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def _ensure_adam_state(optimizer) -> None:
    """Give every parameter of a never-stepped torch Adam/AdamW the state of "zero steps taken".

    Loading builds the optimizer's sharded state dict from its *current* state; with torch's Adam
    (no Apex/TE fused Adam, as on CPU) Megatron reads a per-parameter ``step`` that a fresh optimizer
    does not have yet (its ``init_state_fn`` creates the moments only). Zero moments and ``step=0``
    behave exactly like an empty state, and the load overwrites them anyway.
    """
    for leaf in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(leaf, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _restore_adam_steps(optimizer) -> None:
    """Give every parameter its own, correct Adam ``step`` tensor after a load (torch Adam, no Apex/TE).

    Two Megatron-Core 0.16.1 behaviours on this path: ``DistributedOptimizer.load_state_dict`` puts *one*
    step tensor into every parameter's state, which torch's Adam then increments once per parameter per
    step (a 12 % different loss two steps after resuming); and the ``dp_reshardable`` loader then
    overwrites each step with the loading optimizer's own value (it stores steps as non-persistent
    objects). The distributed optimizer keeps the saved step in its param groups: take it from there.
    """
    for leaf in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(leaf, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state.get(p)
                if not state or not torch.is_tensor(state.get("step")):
                    continue
                step = state["step"].clone()
                if "step" in group:
                    step.fill_(float(group["step"]))
                state["step"] = step


def _sharded_state(trainer, with_optimizer: bool, optimizer_format: str, is_loading: bool) -> Dict[str, Any]:
    sd: Dict[str, Any] = {"model": trainer.module.sharded_state_dict()}
    if with_optimizer:
        # Saving needs it too: before the first optimizer step (a run whose first steps had no signal, or
        # were skipped) Megatron's DistributedOptimizer.state_dict asserts on the missing step counters.
        _ensure_adam_state(trainer.optimizer)
        sd["optimizer"] = trainer.optimizer.sharded_state_dict(
            sd["model"], is_loading=is_loading, metadata=_optimizer_metadata(optimizer_format))
    return sd


# HFArch fields that decide the shapes of the stored tensors
_SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "num_experts", "moe_ffn_hidden_size", "tie_word_embeddings")


def model_signature(arch) -> Dict[str, Any]:
    """The shape-deciding fields of an :class:`~megatron_rl.models.config.HFArch`."""
    return {k: getattr(arch, k) for k in _SHAPE_FIELDS if hasattr(arch, k)}


def signature_mismatch(saved: Optional[Dict[str, Any]], current: Dict[str, Any]) -> Optional[str]:
    """``"hidden_size 64 (checkpoint) vs 128 (this model), ..."`` or None (None too for old checkpoints)."""
    if not saved:
        return None
    diffs = [f"{k} {saved[k]!r} (checkpoint) vs {current[k]!r} (this model)"
             for k in current if k in saved and saved[k] != current[k]]
    return ", ".join(diffs) or None


def _trainer_state(trainer) -> Dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "step": trainer.step,
        "skipped_steps": trainer.skipped_steps,
        "lr": trainer.lr,
        "schedule": None if trainer.schedule is None else trainer.schedule.state_dict(),
        "layout": _layout(trainer),
        "model": dataclasses.asdict(trainer.built.cfg),  # what `megatron-rl export` rebuilds the model from
        "model_shape": model_signature(trainer.built.arch),  # checked before a load (resume with another model)
    }


# ---------------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------------


def _fsync_tree(path: str) -> None:
    for dirpath, _, files in os.walk(path):
        for fn in files:
            fd = os.open(os.path.join(dirpath, fn), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(dirpath)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _first_rank_on_host() -> bool:
    """One rank per host fsyncs: a client flushes the pages it wrote; other hosts flush theirs."""
    hosts: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts.index(hosts[dist.get_rank()]) == dist.get_rank()


def _write_pointer(root: str, name: str) -> None:
    tmp = os.path.join(root, "latest.tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, "latest"))
    _fsync_dir(root)


def _prune(root: str, keep_last: int, protect: str) -> None:
    """Delete all but the ``keep_last`` highest-step checkpoints, never ``protect`` (the one ``latest``
    names: after resuming from an older step, newer checkpoints of the abandoned run may outrank it)."""
    if keep_last <= 0:
        return
    for step in list_checkpoints(root)[:-keep_last]:
        if iter_name(step) != protect:
            shutil.rmtree(os.path.join(root, iter_name(step)), ignore_errors=True)


def _space_needed(trainer, root: str, with_opt: bool) -> int:
    """Bytes the next checkpoint needs: the previous one's size, else an estimate from rank 0's shard of
    the model times the model-parallel size (fp32 Adam: a main copy and two moments per parameter)."""
    try:
        previous = latest_checkpoint(root)
    except ValueError:
        previous = None
    if previous is not None:
        return integrity.dir_bytes(previous)
    params = list(trainer.module.parameters())
    mp = dist.get_world_size() // dist.get_world_size(trainer.groups.dp)
    model = sum(p.numel() * p.element_size() for p in params) * mp
    optim = sum(p.numel() for p in params) * mp * 12 if with_opt else 0
    return int((model + optim) * 1.1) + 2**16


def save_checkpoint(trainer, cfg: CheckpointConfig, extra: Optional[Dict[str, Any]] = None, *,
                    step: Optional[int] = None) -> str:
    """Save ``trainer`` (collective: every rank calls it) as ``cfg.root/iter_<step>``; return the path.

    ``extra`` is an opaque, picklable dict (identical on every rank; rank 0's copy is stored), returned
    by :func:`load_checkpoint`. ``step`` numbers the directory (default: the trainer's optimizer step; an
    RL driver passes its own step, which also counts steps that had nothing to train on). Raises
    :class:`CheckpointSpaceError` on every rank when the disk is (or becomes) too full.
    """
    root, name = os.path.abspath(cfg.root), iter_name(trainer.step if step is None else step)
    tmp, final = os.path.join(root, ".tmp_" + name), os.path.join(root, name)
    rank0 = dist.get_rank() == 0
    with_opt = cfg.save_optimizer and trainer.optimizer is not None
    need = _space_needed(trainer, root, with_opt)

    def prepare() -> None:
        if rank0:
            os.makedirs(root, exist_ok=True)
            for stale in (n for n in os.listdir(root) if n.startswith((".tmp_iter_", ".tmp_old_iter_"))):
                shutil.rmtree(os.path.join(root, stale), ignore_errors=True)  # crashed earlier saves
            problem = integrity.space_problem(root, need)
            if problem is not None:
                raise CheckpointSpaceError(problem)
            os.makedirs(tmp)

    integrity.on_every_rank(prepare, root, need, tmp)
    state = _sharded_state(trainer, with_opt, cfg.optimizer_format, is_loading=False)
    state["rng_state"] = _rng_object(_rng_state())
    state["trainer"] = dict(_trainer_state(trainer), has_optimizer=with_opt, optimizer_format=cfg.optimizer_format)
    state["extra"] = dict(extra or {})
    integrity.on_every_rank(lambda: dist_checkpointing.save(state, tmp), root, need, tmp)
    entries = integrity.checksums(tmp)
    integrity.on_every_rank(lambda: rank0 and integrity.write_manifest(tmp, entries), root, need, tmp)
    if _first_rank_on_host():
        _fsync_tree(tmp)
    dist.barrier()
    if rank0:
        if os.path.exists(final):  # re-saving a step: the new copy replaces the old one (between the two
            # renames ``latest`` may name a missing directory for a moment; ``latest_checkpoint`` then raises)
            old = os.path.join(root, ".tmp_old_" + name)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
        _write_pointer(root, name)
        _prune(root, cfg.keep_last, protect=name)
    dist.barrier()
    return final


# ---------------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------------


@dataclass
class LoadResult:
    """What :func:`load_checkpoint` restored. ``extra`` is the driver's dict as saved."""

    path: str
    step: int
    extra: Dict[str, Any]
    optimizer_loaded: bool
    rng_loaded: bool
    saved_layout: Dict[str, Any]
    skipped: List[str] = field(default_factory=list)  # newer checkpoints found damaged, with the reason


def _candidates(root: str, step: Optional[int]) -> List[str]:
    """``iter_<step>``; or the checkpoint ``latest`` names, then the older complete ones, newest first."""
    if step is not None:
        path = os.path.join(root, iter_name(step))
        if not os.path.isdir(path):
            raise FileNotFoundError(f"no checkpoint {iter_name(step)} under {root} (complete ones: steps "
                                    f"{list_checkpoints(root)})")
        return [path]
    latest = latest_checkpoint(root)
    if latest is None:
        raise FileNotFoundError(f"no checkpoint (latest) under {root}")
    newest = int(_ITER_RE.match(os.path.basename(latest)).group(1))
    return [latest] + [os.path.join(root, iter_name(s)) for s in reversed(list_checkpoints(root)) if s < newest]


def _intact_checkpoint(root: str, step: Optional[int]) -> Tuple[str, Dict[str, Any], List[str]]:
    skipped: List[str] = []
    for path in _candidates(root, step):
        problem, common = integrity.verify_collective(path)
        if problem is None:
            return path, common, skipped
        name = os.path.basename(path)
        if step is not None:
            raise CheckpointCorruptError(f"checkpoint {name} (step {step}) is damaged: {problem}")
        skipped.append(f"{name} is damaged: {problem}")
        if dist.get_rank() == 0:
            logger.warning("checkpoint %s is damaged, trying an older one: %s", name, problem)
    raise CheckpointCorruptError(f"no intact checkpoint under {root}: " + "; ".join(skipped))


def load_checkpoint(trainer, root: str, step: Optional[int] = None, *, load_optimizer: bool = True,
                    load_rng: bool = True) -> LoadResult:
    """Load ``root``'s latest checkpoint (or ``iter_<step>``) into ``trainer`` (collective).

    Files are checked against the checkpoint's manifest first: a damaged latest checkpoint is skipped for
    the newest intact one (``LoadResult.skipped`` says why); a damaged ``iter_<step>`` raises
    :class:`CheckpointCorruptError`. The checkpoint may come from another TP/PP/EP layout (see the module
    docstring for what reshards), not from another model shape.
    """
    path, common, skipped = _intact_checkpoint(root, step)
    saved = common["trainer"]
    if saved.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {saved.get('format_version')} != {FORMAT_VERSION}")
    mismatch = signature_mismatch(saved.get("model_shape"), model_signature(trainer.built.arch))
    if mismatch:
        raise CheckpointMismatchError(f"{path} holds another model: {mismatch}. Resume with the model it was trained "
                                      "from, or start a new run (another logging.output_dir, or overwrite=true)")
    with_opt = load_optimizer and trainer.optimizer is not None
    if with_opt and not saved.get("has_optimizer"):
        raise ValueError(f"{path} holds no optimizer state; load with load_optimizer=False")
    fmt = saved.get("optimizer_format", _FORMATS[0])
    same_layout = saved["layout"] == _layout(trainer)
    model_parallel = ("tp", "pp", "ep", "etp")
    if with_opt and getattr(trainer.built.arch, "is_moe", False) and any(
            saved["layout"][k] != _layout(trainer)[k] for k in ("ep", "etp")):
        raise ValueError(f"{path}: the optimizer state of an MoE model does not reshard across expert parallelism "
                         f"(megatron-core 0.16.1 regroups its expert optimizer; saved layout {saved['layout']}, "
                         f"this one {_layout(trainer)}). Load with load_optimizer=False (the weights reshard)")
    if with_opt and fmt == "dp_reshardable" and any(saved["layout"][k] != _layout(trainer)[k] for k in model_parallel):
        raise ValueError(f"{path}: optimizer state saved as 'dp_reshardable' reshards over data parallelism only; "
                         f"saved layout {saved['layout']}, this one {_layout(trainer)}. Load with "
                         "load_optimizer=False, or save with optimizer_format='fully_reshardable'")
    state = _sharded_state(trainer, with_opt, fmt, is_loading=True)
    with_rng = load_rng and same_layout
    if with_rng:
        state["rng_state"] = _rng_object(None)
    loaded = dist_checkpointing.load(state, path)
    trainer.module.load_state_dict(loaded["model"])
    if with_opt:
        # no_grad: the 'dp_reshardable' loader copies into main-param shards that view the (grad-requiring)
        # fp32 model parameters, without a no_grad of its own.
        with torch.no_grad():
            trainer.optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(trainer.optimizer)
    if with_rng:
        _set_rng_state(loaded["rng_state"])
    trainer.step = saved["step"]
    trainer.skipped_steps = saved["skipped_steps"]
    trainer.lr = saved["lr"]
    if trainer.schedule is not None and saved["schedule"] is not None:
        trainer.schedule.load_state_dict(saved["schedule"])
    dist.barrier()
    return LoadResult(path, saved["step"], common.get("extra", {}), with_opt, with_rng, saved["layout"], skipped)

