"""HF safetensors <-> Megatron weights for any TP / PP / EP (and expert-TP) layout.

* :func:`load_hf_weights` — every rank reads only what its shard needs (safetensors slices: its TP
  rows/columns, its pipeline stage's layers, its EP experts) and copies it into the parameters.
* :func:`iter_hf_weights` — export as a generator of ``(hf_name, full_tensor)`` in a stable order
  (:func:`megatron_rl.models.mapping.units`), so a weight sync can stream it in size-bounded
  buckets. It is *collective*: every rank of the job must iterate it to the end (each tensor is
  gathered over TP / expert-TP / EP and, with ``all_stages=True``, broadcast over PP).
* :func:`export_hf_state_dict` / :func:`save_hf_checkpoint` — the same as a dict, or as an HF
  directory (safetensors shards + index, non-weight files such as ``config.json`` copied) that
  ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

The name/shape/sharding bookkeeping lives in :mod:`megatron_rl.models.mapping`.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_rl.models import deepseek, mapping
from megatron_rl.models.built import Axis, BuiltModel
from megatron_rl.models.mapping import QKVLayout, Unit, shard_range

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


class SafetensorsDir:
    """Random access to the tensors of an HF safetensors directory, reading slices only."""

    def __init__(self, path: str) -> None:
        self._open = safe_open
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = {n: os.path.join(path, fn) for n, fn in json.load(f)["weight_map"].items()}
        else:
            shards = sorted(fn for fn in os.listdir(path) if fn.endswith(".safetensors"))
            if not shards:
                raise FileNotFoundError(f"no *.safetensors in {path} (only safetensors checkpoints are supported)")
            files = {}
            for fn in shards:
                with safe_open(os.path.join(path, fn), framework="pt") as h:
                    files.update({n: os.path.join(path, fn) for n in h.keys()})
        self.path, self._files, self._handles = path, files, {}

    def _slice(self, name: str):
        if name not in self._files:
            raise KeyError(f"tensor {name!r} not found in {self.path}")
        fn = self._files[name]
        if fn not in self._handles:
            self._handles[fn] = self._open(fn, framework="pt")
        return self._handles[fn].get_slice(name)

    @property
    def names(self) -> List[str]:
        return list(self._files)

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, rows: Optional[Tuple[int, int]] = None, cols: Optional[Tuple[int, int]] = None):
        sl = self._slice(name)
        r = slice(*rows) if rows else slice(None)
        if cols is None:
            return sl[r]
        return sl[r, slice(*cols)]


# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------


def _owner_stage(built: BuiltModel, unit: Unit) -> int:
    if unit.layer is not None:
        return built.shard.stage_of_layer(unit.layer)
    return 0 if unit.role == "embedding" else built.shard.pp.size - 1


def _local_param(built: BuiltModel, unit: Unit, layers: Dict[int, object]):
    """The local parameter of ``unit`` on this rank, or None when this stage does not hold it."""
    if unit.layer is not None:
        lm = layers.get(unit.layer)
        return None if lm is None else (lm if unit.kind == "experts" else mapping.locate(unit.role, None, lm))
    if unit.role == "embedding" and not built.pre_process:
        return None
    if unit.role in ("final_norm", "output") and not built.post_process:
        return None
    if unit.role == "output" and built.module.output_layer.weight is None:
        return None  # tied embeddings on a single stage: the output layer reuses the embedding
    return mapping.locate(unit.role, built.module)


def _check_shapes(reader: SafetensorsDir, unit: Unit) -> None:
    for name, shape in unit.hf:
        got = reader.shape(name)
        if got != shape:
            raise ValueError(f"{reader.path}: {name} has shape {got}, the config implies {shape}")


def _load_vocab(reader, name, vocab, local: torch.Tensor, axis: Axis) -> torch.Tensor:
    r0, r1 = shard_range(local.shape[0] * axis.size, axis.rank, axis.size, "padded vocabulary")
    out = torch.zeros_like(local, device="cpu")
    if r0 < vocab:
        out[: min(r1, vocab) - r0] = reader.read(name, rows=(r0, min(r1, vocab)))
    return out


def _load_qkv(reader, names, qkv: QKVLayout, axis: Axis) -> torch.Tensor:
    r0, r1, g0, g1 = qkv.rank_groups(axis.rank, axis.size)
    hd, qpg = qkv.head_dim, qkv.q_per_group
    q = reader.read(names[0], rows=(g0 * qpg * hd, g1 * qpg * hd))
    k = reader.read(names[1], rows=(g0 * hd, g1 * hd))
    v = reader.read(names[2], rows=(g0 * hd, g1 * hd))
    fused = qkv.interleave(q, k, v)
    base = g0 * qkv.group_rows
    return fused[r0 - base : r1 - base]


def _load_glu(reader, gate: str, up: str, rows: int, axis: Axis) -> torch.Tensor:
    rng = shard_range(rows, axis.rank, axis.size, f"{gate} rows")
    return torch.cat([reader.read(gate, rows=rng), reader.read(up, rows=rng)])


def _load_row(reader, name: str, cols: int, axis: Axis) -> torch.Tensor:
    return reader.read(name, cols=shard_range(cols, axis.rank, axis.size, f"{name} columns"))


def _copy(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(f"{name}: local shard shape {tuple(value.shape)} != parameter {tuple(param.shape)}")
    with torch.no_grad():
        param.data.copy_(value.to(param.dtype))  # in place: DDP buffers may view these parameters


def _load_unit(built: BuiltModel, reader: SafetensorsDir, unit: Unit, target) -> List[torch.Tensor]:
    arch, tp = built.arch, built.shard.tp
    names = unit.hf_names
    if unit.kind == "experts":
        etp, loaded = built.shard.etp, []
        for e, fc1, fc2 in mapping.local_experts(target):
            gate, up, down = names[3 * e : 3 * e + 3]
            _copy(fc1, _load_glu(reader, gate, up, arch.moe_ffn_hidden_size, etp), gate)
            _copy(fc2, _load_row(reader, down, arch.moe_ffn_hidden_size, etp), down)
            loaded += [fc1, fc2]
        return loaded
    if unit.kind == "replicated":
        value = reader.read(names[0])
    elif unit.kind == "vocab":
        value = _load_vocab(reader, names[0], arch.vocab_size, target, tp)
    elif unit.kind == "row":
        value = _load_row(reader, names[0], unit.hf[0][1][1], tp)
    elif unit.kind == "column":
        value = reader.read(names[0], rows=shard_range(unit.hf[0][1][0], tp.rank, tp.size, f"{names[0]} rows"))
    elif unit.kind == "qkv":
        value = _load_qkv(reader, names, QKVLayout(arch.num_heads, arch.num_kv_heads, arch.head_dim), tp)
    elif unit.kind == "glu":
        value = _load_glu(reader, names[0], names[1], unit.hf[0][1][0], tp)
    else:
        raise AssertionError(unit.kind)
    _copy(target, value, names[0])
    return [target]


def load_hf_weights(built: BuiltModel, hf_dir: str) -> None:
    """Copy this rank's shard of the HF safetensors in ``hf_dir`` into ``built.module``'s parameters.

    Raises ValueError when a tensor's shape disagrees with the config or a parameter is left unset.
    """
    reader = SafetensorsDir(hf_dir)
    if built.arch.sigmoid_router is not None:
        deepseek.warn_ignored_mtp(built.arch, reader.names, hf_dir)
    layers = dict(built.layers())
    loaded = set()
    for unit in mapping.units(built.arch):
        target = _local_param(built, unit, layers)
        if target is None:
            continue
        _check_shapes(reader, unit)
        loaded.update(id(p) for p in _load_unit(built, reader, unit, target))
    missing = [n for n, p in built.module.named_parameters() if id(p) not in loaded]
    if missing:
        raise ValueError(f"parameters with no HF counterpart were left uninitialised: {missing}")


# ------------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------------


def _gather(t: torch.Tensor, axis: Axis) -> List[torch.Tensor]:
    t = t.detach().contiguous()
    if axis.size == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(axis.size)]
    if dist.get_backend(axis.group) != "gloo":
        dist.all_gather(out, t, group=axis.group)
        return out
    # gloo's all_gather moves MB-sized tensors 3-4x slower than its send/recv on a small CPU machine (2 ranks:
    # 37 MB in 121 ms vs 36 ms, weights/links.py): exchange the shards pairwise instead
    n, r = axis.size, axis.rank
    out[r] = t
    works = []
    for k in range(1, n):
        works.append(dist.isend(t, dst=dist.get_global_rank(axis.group, (r + k) % n), group=axis.group))
        works.append(dist.irecv(out[(r - k) % n], src=dist.get_global_rank(axis.group, (r - k) % n), group=axis.group))
    for w in works:
        w.wait()
    return out


def _gather_experts(built: BuiltModel, layer_module) -> List[torch.Tensor]:
    """All experts of one layer as HF tensors [gate_0, up_0, down_0, gate_1, ...]."""
    shard = built.shard
    experts = mapping.local_experts(layer_module)
    fc1 = _gather(torch.stack([w1 for _, w1, _ in experts]), shard.etp)  # etp x [nl, 2F/etp, H]
    fc2 = _gather(torch.stack([w2 for _, _, w2 in experts]), shard.etp)  # etp x [nl, H, F/etp]
    gate, up = (torch.stack(x) for x in zip(*(mapping.merge_glu([s[j] for s in fc1]) for j in range(len(experts)))))
    down = torch.cat(fc2, dim=2)
    gate, up, down = (torch.cat(_gather(x, shard.ep)) for x in (gate, up, down))  # [E, ...]
    return [t for e in range(gate.shape[0]) for t in (gate[e], up[e], down[e])]


def _gather_unit(built: BuiltModel, unit: Unit, target) -> List[torch.Tensor]:
    arch, tp = built.arch, built.shard.tp
    if unit.kind == "experts":
        return _gather_experts(built, target)
    if unit.kind == "replicated":
        return [target.detach()]
    shards = _gather(target, tp)
    if unit.kind == "vocab":
        return [_cat(shards)[: arch.vocab_size]]
    if unit.kind == "row":
        return [_cat(shards, dim=1)]
    if unit.kind == "column":
        return [_cat(shards)]
    if unit.kind == "qkv":
        return list(QKVLayout(arch.num_heads, arch.num_kv_heads, arch.head_dim).split(_cat(shards)))
    if unit.kind == "glu":
        if len(shards) == 1:
            return list(shards[0].chunk(2, dim=0))
        return list(mapping.merge_glu(shards))
    raise AssertionError(unit.kind)


def _cat(parts: List[torch.Tensor], dim: int = 0) -> torch.Tensor:
    # At TP=1 there is nothing to concatenate: a view instead of a copy of every weight (the weight
    # sync's export then costs no extra memory traffic; yielded tensors may alias parameters anyway).
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def iter_hf_weights(built: BuiltModel, *, all_stages: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for the whole model in a stable order. Collective.

    ``all_stages=True``: every rank yields every tensor (pipeline stages broadcast their layers over
    the PP group). ``all_stages=False``: each rank yields only its own stage's tensors, in the same
    relative order (no PP communication). Yielded tensors may alias parameters: copy before
    modifying them.
    """
    shard = built.shard
    layers = dict(built.layers())
    dtype = built.tconfig.params_dtype
    device = next(built.module.parameters()).device
    for unit in mapping.units(built.arch):
        if not unit.export:
            continue
        owner = _owner_stage(built, unit)
        mine = owner == shard.pp.rank
        tensors = _gather_unit(built, unit, _local_param(built, unit, layers)) if mine else None
        if shard.pp.size > 1 and all_stages:
            src = dist.get_global_rank(shard.pp.group, owner)
            unit_dtype = torch.float32 if unit.role in deepseek.FLOAT32_ROLES else dtype
            for i, (name, shape) in enumerate(unit.hf):
                buf = tensors[i].contiguous() if mine else torch.empty(shape, dtype=unit_dtype, device=device)
                dist.broadcast(buf, src=src, group=shard.pp.group)
                yield name, buf
        elif mine:
            yield from zip(unit.hf_names, tensors)


def export_hf_state_dict(built: BuiltModel) -> Dict[str, torch.Tensor]:
    """The full HF state dict on every rank (collective). For big models prefer :func:`iter_hf_weights`."""
    return {name: t.clone() for name, t in iter_hf_weights(built, all_stages=True)}


def save_hf_checkpoint(
    built: BuiltModel, out_dir: str, *, src_dir: Optional[str] = None, max_shard_bytes: int = 4 << 30
) -> None:
    """Write an HF checkpoint directory from global rank 0 (collective: every rank must call it).

    Tensors are streamed into safetensors shards of at most ``max_shard_bytes`` (plus an index when
    there are several). Non-weight files of ``src_dir`` (default: ``built.cfg.hf_path``) —
    ``config.json``, generation config, tokenizer — are copied alongside.
    """
    writer = not dist.is_initialized() or dist.get_rank() == 0
    src_dir = src_dir or built.cfg.hf_path
    shards: List[Dict[str, str]] = []
    bucket: Dict[str, torch.Tensor] = {}
    size = total_bytes = 0

    def flush() -> None:
        nonlocal bucket, size
        fn = f"model-part-{len(shards):05d}.safetensors"
        save_file(bucket, os.path.join(out_dir, fn), metadata={"format": "pt"})
        # safetensors writes through a private (0600) temporary file: give it the mode open() gives its siblings
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(os.path.join(out_dir, fn), 0o666 & ~umask)
        shards.append({n: fn for n in bucket})
        bucket, size = {}, 0

    if writer:
        os.makedirs(out_dir, exist_ok=True)
    for name, t in iter_hf_weights(built, all_stages=True):
        if not writer:
            continue
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > max_shard_bytes:
            flush()
        bucket[name] = t.detach().to("cpu", copy=True).contiguous()
        size += nbytes
        total_bytes += nbytes
    if writer:
        if bucket:
            flush()
        _finalise_shards(out_dir, shards, total_bytes)
        if os.path.isdir(src_dir):
            for fn in os.listdir(src_dir):
                full = os.path.join(src_dir, fn)
                if os.path.isfile(full) and not fn.endswith(_WEIGHT_SUFFIXES):
                    shutil.copy2(full, os.path.join(out_dir, fn))
        else:  # e.g. a hub id: at least the config, so that from_pretrained works
            from transformers import AutoConfig

            AutoConfig.from_pretrained(src_dir).save_pretrained(out_dir)
    if dist.is_initialized():
        dist.barrier()


def _finalise_shards(out_dir: str, shards: List[Dict[str, str]], total_bytes: int) -> None:
    """Rename the parts to HF's names; write the index when there is more than one."""
    if len(shards) == 1:
        os.replace(os.path.join(out_dir, next(iter(shards[0].values()))), os.path.join(out_dir, "model.safetensors"))
        return
    weight_map = {}
    for i, names in enumerate(shards):
        part = next(iter(names.values()))
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(os.path.join(out_dir, part), os.path.join(out_dir, final))
        weight_map.update({n: final for n in names})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, f, indent=2)
