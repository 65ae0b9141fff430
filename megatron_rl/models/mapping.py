"""HF <-> Megatron parameter correspondence: names, full shapes, and how each tensor is sharded.

Pure bookkeeping and tensor algebra, no communication (that is :mod:`megatron_rl.models.weights`).

We write the mapping ourselves rather than use ``mbridge`` (0.15.1 on PyPI): it builds models with
the Transformer Engine spec only, maps only TE's fused names (``linear_qkv.layer_norm_weight``) and
moves tensors to ``torch.cuda.current_device()``, so it serves neither our portable CPU spec nor CPU
machines. Parameters are located by module structure, so both the TE and the local spec work.

A :class:`Unit` is one Megatron parameter (or, for experts, one layer's expert weights) and the HF
tensors it corresponds to, in the stable export order given by :func:`units`.

Sharding kinds (``P`` = the TP or expert-TP group, ``r`` its rank, ``n`` its size):

* ``replicated`` — norms, q/k norms, the router: every rank holds the full tensor.
* ``vocab`` — embedding / output layer ``[V_pad, H]``: rows split over TP after padding ``V`` to
  ``V_pad``; padded rows are zero and dropped on export.
* ``column`` — column-parallel linears (MLA's projections): the output dimension (dim 0) is split.
* ``row`` — row-parallel linears (``o_proj``, ``down_proj``): the input dimension (dim 1) is split.
* ``qkv`` — Megatron fuses q/k/v per query group: for each KV head ``g`` the rows are
  ``[q heads of g | k_g | v_g]`` (``heads/kv_heads + 2`` head blocks); the interleaved tensor is
  split contiguously over TP (a rank may hold part of a group when ``kv_heads < TP``).
* ``glu`` — SwiGLU ``linear_fc1``: each rank holds ``cat(gate_shard_r, up_shard_r)``.
* ``experts`` — one MoE layer's experts: ``glu``/``row`` over the expert-TP group per expert,
  experts split over EP (rank ``e`` holds ``local_expert_indices``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron_rl.models import deepseek
from megatron_rl.models.config import HFArch

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class Unit:
    kind: str  # replicated | vocab | column | row | qkv | glu | experts
    role: str  # which Megatron parameter: see locate()
    layer: Optional[int]  # global layer index; None for embedding / final norm / lm_head
    hf: Tuple[Tuple[str, Shape], ...]  # HF names and full shapes, in export order
    export: bool = True  # False for the tied lm_head copy (HF checkpoints omit it)

    @property
    def hf_names(self) -> Tuple[str, ...]:
        return tuple(n for n, _ in self.hf)


def _expert_names(arch: HFArch, layer: int, e: int) -> Tuple[str, str, str]:
    """(gate, up, down) names as HF *checkpoints* store them (transformers 5 fuses experts only in
    memory and converts back on save)."""
    if arch.model_type == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe.experts.{e}."
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    p = f"model.layers.{layer}.mlp.experts.{e}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def _router_name(arch: HFArch, layer: int) -> str:
    block = "block_sparse_moe" if arch.model_type == "mixtral" else "mlp"
    return f"model.layers.{layer}.{block}.gate.weight"


def layer_units(arch: HFArch, layer: int) -> List[Unit]:
    H, hd = arch.hidden_size, arch.head_dim
    p = f"model.layers.{layer}."
    a = p + "self_attn."
    qkv_rows = ((a + "q_proj", arch.num_heads * hd), (a + "k_proj", arch.num_kv_heads * hd), (a + "v_proj", arch.num_kv_heads * hd))
    out = [Unit("replicated", "input_norm", layer, ((p + "input_layernorm.weight", (H,)),))]
    if arch.mla is not None:
        out += deepseek.attention_units(Unit, arch, layer)
    else:
        out.append(Unit("qkv", "qkv_weight", layer, tuple((n + ".weight", (r, H)) for n, r in qkv_rows)))
        if arch.qkv_bias:
            out.append(Unit("qkv", "qkv_bias", layer, tuple((n + ".bias", (r,)) for n, r in qkv_rows)))
        if arch.qk_norm:
            out.append(Unit("replicated", "q_norm", layer, ((a + "q_norm.weight", (hd,)),)))
            out.append(Unit("replicated", "k_norm", layer, ((a + "k_norm.weight", (hd,)),)))
        out.append(Unit("row", "attn_out", layer, ((a + "o_proj.weight", (H, arch.num_heads * hd)),)))
    out.append(Unit("replicated", "post_norm", layer, ((p + "post_attention_layernorm.weight", (H,)),)))
    if arch.is_moe and arch.moe_layers[layer]:
        F, E = arch.moe_ffn_hidden_size, arch.num_experts
        out.append(Unit("replicated", "router", layer, ((_router_name(arch, layer), (E, H)),)))
        if arch.sigmoid_router is not None:
            out += deepseek.moe_extra_units(Unit, arch, layer)
        names = []
        for e in range(E):
            gate, up, down = _expert_names(arch, layer, e)
            names += [(gate, (F, H)), (up, (F, H)), (down, (H, F))]
        out.append(Unit("experts", "experts", layer, tuple(names)))
    else:
        F = arch.ffn_hidden_size
        m = p + "mlp."
        out.append(Unit("glu", "fc1", layer, ((m + "gate_proj.weight", (F, H)), (m + "up_proj.weight", (F, H)))))
        out.append(Unit("row", "fc2", layer, ((m + "down_proj.weight", (H, F)),)))
    return out


def units(arch: HFArch) -> List[Unit]:
    """Every unit of the model in the stable export order: embedding, layers 0.., final norm, lm_head."""
    V, H = arch.vocab_size, arch.hidden_size
    out = [Unit("vocab", "embedding", None, (("model.embed_tokens.weight", (V, H)),))]
    for layer in range(arch.num_layers):
        out += layer_units(arch, layer)
    out.append(Unit("replicated", "final_norm", None, (("model.norm.weight", (H,)),)))
    if arch.tie_word_embeddings:
        # A last pipeline stage without the embedding keeps its own copy of the tied weight.
        out.append(Unit("vocab", "output", None, (("model.embed_tokens.weight", (V, H)),), export=False))
    else:
        out.append(Unit("vocab", "output", None, (("lm_head.weight", (V, H)),)))
    return out


def hf_shapes(arch: HFArch) -> Dict[str, Shape]:
    """HF checkpoint tensor names -> shapes, in export order."""
    return {n: s for u in units(arch) if u.export for n, s in u.hf}


# ------------------------------------------------------------------------------------------------
# Locating Megatron parameters (local spec and TE spec names)
# ------------------------------------------------------------------------------------------------


def _norm_weight(norm, fused_owner) -> torch.nn.Parameter:
    w = getattr(norm, "weight", None)
    if isinstance(w, torch.nn.Parameter):
        return w
    return fused_owner.layer_norm_weight  # TE fuses the norm into the following linear


def locate(role: str, model, layer_module=None) -> torch.nn.Parameter:
    """The local Megatron parameter for ``role`` (not for ``experts``: see :func:`local_experts`)."""
    lm = layer_module
    if role == "embedding":
        return model.embedding.word_embeddings.weight
    if role == "final_norm":
        return model.decoder.final_layernorm.weight
    if role == "output":
        return model.output_layer.weight
    if role in deepseek.LOCATORS:
        return deepseek.LOCATORS[role](lm)
    attn = lm.self_attention
    if role == "input_norm":
        # TE fuses it into linear_qkv (GQA) or keeps it separate (MLA: no linear_qkv)
        return _norm_weight(lm.input_layernorm, getattr(attn, "linear_qkv", None))
    if role == "qkv_weight":
        return attn.linear_qkv.weight
    if role == "qkv_bias":
        return attn.linear_qkv.bias
    if role == "q_norm":
        return attn.q_layernorm.weight
    if role == "k_norm":
        return attn.k_layernorm.weight
    if role == "attn_out":
        return attn.linear_proj.weight
    if role == "post_norm":
        return _norm_weight(lm.pre_mlp_layernorm, getattr(lm.mlp, "linear_fc1", None))
    if role == "fc1":
        return lm.mlp.linear_fc1.weight
    if role == "fc2":
        return lm.mlp.linear_fc2.weight
    if role == "router":
        return lm.mlp.router.weight
    raise KeyError(role)


def local_experts(layer_module) -> List[Tuple[int, torch.nn.Parameter, torch.nn.Parameter]]:
    """``(global expert index, fc1 weight, fc2 weight)`` for this rank's experts of one MoE layer."""
    mlp = layer_module.mlp
    experts = mlp.experts
    if hasattr(experts, "local_experts"):  # SequentialMLP (local or TE linears)
        pairs = [(m.linear_fc1.weight, m.linear_fc2.weight) for m in experts.local_experts]
    elif hasattr(experts.linear_fc1, "weight0"):  # TEGroupedMLP: weight{j} per local expert
        pairs = [
            (getattr(experts.linear_fc1, f"weight{j}"), getattr(experts.linear_fc2, f"weight{j}"))
            for j in range(experts.num_local_experts)
        ]
    else:
        raise ValueError(f"unsupported expert module {type(experts).__name__} (legacy GroupedMLP?)")
    return [(e, fc1, fc2) for e, (fc1, fc2) in zip(mlp.local_expert_indices, pairs)]


# ------------------------------------------------------------------------------------------------
# Tensor algebra of the layouts
# ------------------------------------------------------------------------------------------------


def shard_range(total: int, rank: int, size: int, what: str = "dimension") -> Tuple[int, int]:
    if total % size:
        raise ValueError(f"{what} of size {total} is not divisible by the parallel size {size}")
    step = total // size
    return rank * step, (rank + 1) * step


@dataclass(frozen=True)
class QKVLayout:
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def q_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def group_rows(self) -> int:
        return (self.q_per_group + 2) * self.head_dim

    def interleave(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """HF q ``[G*qpg*hd, ...]``, k/v ``[G*hd, ...]`` for G consecutive groups -> Megatron rows."""
        hd, qpg = self.head_dim, self.q_per_group
        groups = k.shape[0] // hd
        tail = q.shape[1:]
        q = q.reshape(groups, qpg * hd, *tail)
        k = k.reshape(groups, hd, *tail)
        v = v.reshape(groups, hd, *tail)
        return torch.cat([q, k, v], dim=1).reshape(groups * self.group_rows, *tail)

    def split(self, fused: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`interleave` for the full tensor."""
        hd, qpg = self.head_dim, self.q_per_group
        tail = fused.shape[1:]
        g = fused.reshape(self.num_kv_heads, self.group_rows, *tail)
        q, k, v = torch.split(g, [qpg * hd, hd, hd], dim=1)
        return (
            q.reshape(self.num_heads * hd, *tail),
            k.reshape(self.num_kv_heads * hd, *tail),
            v.reshape(self.num_kv_heads * hd, *tail),
        )

    def rank_groups(self, rank: int, size: int) -> Tuple[int, int, int, int]:
        """Rank's rows ``[r0, r1)`` of the fused tensor and the groups ``[g0, g1)`` covering them."""
        r0, r1 = shard_range(self.num_kv_heads * self.group_rows, rank, size, "fused qkv rows")
        return r0, r1, r0 // self.group_rows, -(-r1 // self.group_rows)


def merge_glu(shards: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-rank ``cat(gate_r, up_r)`` shards -> full (gate, up)."""
    halves = [s.chunk(2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])
