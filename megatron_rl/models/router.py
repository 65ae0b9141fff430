"""MoE routing access: record each MoE layer's chosen experts, or force them (routing replay, "R3").

Wraps Megatron-Core's ``RouterReplay`` (``megatron.core.transformer.moe.router_replay``; the model
must be built with ``ModelConfig.routing_replay=True``, the default). Unlike ``RouterReplay``'s static
methods, which drive *every* router ever built in the process through a class-level list, everything
here addresses the routers of one model, so an actor and a reference model can coexist.

Token order: expert ids are ``[tokens, topk]`` int64 with tokens in Megatron's flattened ``[s, b]``
order (sequence-major: token ``i*b + j`` is position ``i`` of sequence ``j``); use
:func:`tokens_from_batch_major` to convert a ``[b, s, topk]`` tensor. With sequence parallelism each TP
rank routes only its contiguous ``s/TP`` slice: recording gathers the full sequence by default,
replay takes full-sequence ids and slices them. Layers are identified by their global (0-based)
index; with pipeline parallelism a rank only sees its stage's MoE layers.

Replay (``REPLAY_FORWARD``) takes the router's scores *at the given ids*, so gradients reach the
router weight through the chosen experts' gate probabilities. Not handled yet: activation recompute
of MoE layers, which needs ``RouterReplayAction.REPLAY_BACKWARD`` during the backward pass.

Example::

    with record_routing(built) as rec:
        built.module(input_ids, position_ids, attention_mask=None)
    ids = rec.last()                         # {layer: LongTensor[s*b, topk]}
    with replay_routing(built, ids):
        logits = built.module(input_ids, position_ids, attention_mask=None)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_rl.models.build import BuiltModel


def moe_routers(built: BuiltModel) -> List[Tuple[int, torch.nn.Module]]:
    """``(global layer index, TopKRouter)`` for this stage's MoE layers, in layer order."""
    return [(i, layer.mlp.router) for i, layer in built.layers() if hasattr(layer.mlp, "router")]


def tokens_from_batch_major(ids: torch.Tensor) -> torch.Tensor:
    """``[b, s, topk]`` -> ``[s*b, topk]`` in Megatron's sequence-major token order."""
    if ids.dim() != 3:
        raise ValueError(f"expected [batch, seq, topk] expert ids, got shape {tuple(ids.shape)}")
    return ids.transpose(0, 1).reshape(-1, ids.shape[-1])


def tokens_to_batch_major(ids: torch.Tensor, batch_size: int) -> torch.Tensor:
    """``[s*b, topk]`` -> ``[b, s, topk]``."""
    return ids.reshape(-1, batch_size, ids.shape[-1]).transpose(0, 1)


def _replays(built: BuiltModel):
    if not built.arch.is_moe:
        raise ValueError(f"routing access needs an MoE model; {built.arch.model_type!r} is dense")
    if not built.tconfig.moe_enable_routing_replay:
        raise ValueError("the model was built without routing replay: set ModelConfig.routing_replay=True")
    return [(i, r, r.router_replay) for i, r in moe_routers(built)]


def _sp_axis(built: BuiltModel):
    tp = built.shard.tp
    return tp if built.tconfig.sequence_parallel and tp.size > 1 else None


@contextlib.contextmanager
def _action(built: BuiltModel, action, hooks: List) -> Iterator[None]:
    handles = [h() for h in hooks]
    for _, _, replay in _replays(built):
        replay.clear_indices()
        replay.set_router_replay_action(action)
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for _, _, replay in _replays(built):
            replay.clear_router_replay_action()
            replay.clear_indices()  # also drops the replay-backward queue, which only grows


@dataclass
class RoutingRecord:
    """Expert ids recorded per MoE layer, one ``[tokens, topk]`` tensor per router call (micro-batch)."""

    calls: Dict[int, List[torch.Tensor]] = field(default_factory=dict)

    @property
    def layers(self) -> List[int]:
        return sorted(self.calls)

    def last(self) -> Dict[int, torch.Tensor]:
        """``{layer: [tokens, topk]}`` of the latest forward."""
        return {layer: calls[-1] for layer, calls in sorted(self.calls.items())}

    def stacked(self, call: int = -1) -> torch.Tensor:
        """``[num_moe_layers, tokens, topk]`` of one forward, layers in ascending order."""
        return torch.stack([self.calls[layer][call] for layer in self.layers])


@contextlib.contextmanager
def record_routing(built: BuiltModel, *, gather_sequence_parallel: bool = True) -> Iterator[RoutingRecord]:
    """Record the top-k expert ids chosen by every local MoE layer during the forwards in the block.

    With sequence parallelism and ``gather_sequence_parallel`` the ids are all-gathered over TP (a
    collective inside each router call: all TP ranks run the same forwards anyway).
    """
    record = RoutingRecord()
    sp = _sp_axis(built) if gather_sequence_parallel else None

    def hook_for(layer: int, router) -> callable:
        def after_forward(_module, _inputs, _outputs) -> None:
            ids = router.router_replay.get_recorded_indices().detach()
            if sp is not None:
                parts = [torch.empty_like(ids) for _ in range(sp.size)]
                dist.all_gather(parts, ids.contiguous(), group=sp.group)
                ids = torch.cat(parts)
            record.calls.setdefault(layer, []).append(ids.clone())

        return lambda: router.register_forward_hook(after_forward)

    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    hooks = [hook_for(i, r) for i, r, _ in _replays(built)]
    with _action(built, RouterReplayAction.RECORD, hooks):
        yield record


class RoutingReplayer:
    """Feeds target expert ids to the routers; call :meth:`set` before each micro-batch forward."""

    def __init__(self, built: BuiltModel) -> None:
        self._built = built
        self._routers = _replays(built)
        self._sp = _sp_axis(built)

    def set(self, topk_ids: Mapping[int, torch.Tensor]) -> None:
        """``{global layer: [tokens, topk]}`` for (at least) every local MoE layer, full sequence."""
        missing = [i for i, _, _ in self._routers if i not in topk_ids]
        if missing:
            raise ValueError(f"routing replay: no expert ids for MoE layer(s) {missing} of this stage")
        arch = self._built.arch
        for layer, _, replay in self._routers:
            ids = torch.as_tensor(topk_ids[layer])
            if ids.dim() != 2 or ids.shape[1] != arch.moe_topk:
                raise ValueError(
                    f"routing replay, layer {layer}: expected [tokens, topk={arch.moe_topk}], got {tuple(ids.shape)}"
                )
            if ids.numel() and (ids.min() < 0 or ids.max() >= arch.num_experts):
                raise ValueError(f"routing replay, layer {layer}: expert ids outside [0, {arch.num_experts})")
            if self._sp is not None:
                if ids.shape[0] % self._sp.size:
                    raise ValueError(
                        f"routing replay, layer {layer}: {ids.shape[0]} tokens do not split over TP={self._sp.size}"
                    )
                ids = ids.chunk(self._sp.size)[self._sp.rank]
            replay.set_target_indices(ids.long())


def _check_alignment(layer: int, router, sp_size: int):
    def before_forward(_module, args, kwargs=None) -> None:
        hidden = args[0]
        tokens = hidden.numel() // hidden.shape[-1]
        target = router.router_replay.target_topk_idx
        if target is None:
            raise ValueError(f"routing replay: layer {layer} ran without target expert ids (call set())")
        if target.shape[0] != tokens:
            # Counts in full-sequence terms (each sequence-parallel rank holds 1/sp_size of them).
            raise ValueError(
                f"routing replay, layer {layer}: {target.shape[0] * sp_size} tokens of expert ids but the "
                f"model routes {tokens * sp_size} (ids must be [s*b, topk], sequence-major, full sequence)"
            )

    return lambda: router.register_forward_pre_hook(before_forward)


@contextlib.contextmanager
def replay_routing(built: BuiltModel, topk_ids: Optional[Mapping[int, torch.Tensor]] = None) -> Iterator[RoutingReplayer]:
    """Force the routers to the given expert ids during the forwards in the block.

    ``topk_ids`` (``{global layer: [tokens, topk]}``) is set at once if given; with several
    micro-batches call ``replayer.set(...)`` before each forward instead. A token-count mismatch
    between the ids and the router's input raises ValueError.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    sp = _sp_axis(built)
    hooks = [_check_alignment(i, r, sp.size if sp else 1) for i, r, _ in _replays(built)]
    with _action(built, RouterReplayAction.REPLAY_FORWARD, hooks):
        replayer = RoutingReplayer(built)
        if topk_ids is not None:
            replayer.set(topk_ids)
        yield replayer
