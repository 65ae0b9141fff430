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

Replay takes the router's scores *at the given ids*, so gradients reach the router weight through the
chosen experts' gate probabilities. A row of ``-1`` (:data:`FREE`) leaves that token to the model's
own router (e.g. the last response token, whose routing SGLang never computes). With activation
recompute the recomputed forward (run inside autograd's backward) replays the ids of the original
forward, popped in forward order (Megatron's ``REPLAY_BACKWARD`` queue semantics); every forward in a
replay block must then be a training forward followed by its backward, as in the pipeline schedules.
``replay_routing(..., shadow=True)`` also records the experts the model's own router would have
chosen for the same inputs (the "shadow" routing, for agreement metrics), at no extra forward.

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
from megatron.core.transformer.moe.router_replay import RouterReplayAction

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


FREE = -1  # a whole row of FREE: no target for this token, the model's router decides


def _in_backward() -> bool:
    """True inside autograd's backward pass (where activation recompute re-runs forwards)."""
    return torch._C._current_graph_task_id() != -1


def _replays(built: BuiltModel):
    if not built.arch.is_moe:
        raise ValueError(f"routing access needs an MoE model; {built.arch.model_type!r} is dense")
    if not built.tconfig.moe_enable_routing_replay:
        raise ValueError("the model was built without routing replay: set ModelConfig.routing_replay=True")
    if getattr(built.tconfig, "moe_router_fusion", False):
        raise ValueError("the fused (Transformer Engine) router bypasses routing replay: set moe_router_fusion=False")
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
            if _in_backward():  # an activation-recompute forward: already recorded
                return
            ids = router.router_replay.get_recorded_indices().detach()
            if sp is not None:
                parts = [torch.empty_like(ids) for _ in range(sp.size)]
                dist.all_gather(parts, ids.contiguous(), group=sp.group)
                ids = torch.cat(parts)
            record.calls.setdefault(layer, []).append(ids.clone())

        return lambda: router.register_forward_hook(after_forward)

    hooks = [hook_for(i, r) for i, r, _ in _replays(built)]
    with _action(built, RouterReplayAction.RECORD, hooks):
        yield record


class RoutingReplayer:
    """Feeds target expert ids to the routers; call :meth:`set` before each micro-batch forward.

    ``shadow`` (with ``replay_routing(..., shadow=True)``): the experts each router would have chosen
    itself in the replayed forwards, one ``[tokens, topk]`` entry per forward (recomputes excluded).
    ``replayed``: (token, layer) pairs whose experts were forced (not :data:`FREE`) in this rank's
    forwards, recomputes excluded; this rank's tokens only (a sequence-parallel shard of them).
    """

    def __init__(self, built: BuiltModel, shadow: bool = False) -> None:
        self._built = built
        self._routers = _replays(built)
        self._sp = _sp_axis(built)
        self._recompute = built.tconfig.recompute_granularity is not None
        self.shadow: Optional[RoutingRecord] = RoutingRecord() if shadow else None
        self._target: Dict[int, Optional[Tuple[torch.Tensor, bool]]] = {i: None for i, _, _ in self._routers}
        self._queue: Dict[int, List[Tuple[torch.Tensor, bool]]] = {i: [] for i, _, _ in self._routers}
        self.replayed = 0

    def set(self, topk_ids: Mapping[int, torch.Tensor]) -> None:
        """``{global layer: [tokens, topk]}`` for (at least) every local MoE layer, full sequence; rows of
        :data:`FREE` leave the token to the model's own router."""
        missing = [i for i, _, _ in self._routers if i not in topk_ids]
        if missing:
            raise ValueError(f"routing replay: no expert ids for MoE layer(s) {missing} of this stage")
        arch = self._built.arch
        for layer, _, _ in self._routers:
            ids = torch.as_tensor(topk_ids[layer])
            if ids.dim() != 2 or ids.shape[1] != arch.moe_topk:
                raise ValueError(
                    f"routing replay, layer {layer}: expected [tokens, topk={arch.moe_topk}], got {tuple(ids.shape)}"
                )
            check_expert_ids(ids, arch.num_experts, f"routing replay, layer {layer}")
            if self._sp is not None:
                if ids.shape[0] % self._sp.size:
                    raise ValueError(
                        f"routing replay, layer {layer}: {ids.shape[0]} tokens do not split over TP={self._sp.size}"
                    )
                ids = ids.chunk(self._sp.size)[self._sp.rank]
            self._target[layer] = (ids.long(), bool((ids[:, 0] == FREE).any()) if ids.numel() else False)

    def _topk_for(self, layer: int):
        sp_size = self._sp.size if self._sp is not None else 1

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if _in_backward():  # activation recompute: the ids of the matching original forward
                if not self._queue[layer]:
                    raise RuntimeError(f"routing replay, layer {layer}: a recomputed forward has no recorded ids")
                ids, has_free = self._queue[layer].pop(0)
                recompute = True
            else:
                target = self._target[layer]
                if target is None:
                    raise ValueError(f"routing replay: layer {layer} ran without target expert ids (call set())")
                ids, has_free = target
                recompute = False
                if self._recompute:
                    self._queue[layer].append(target)
                self.replayed += int((ids[:, 0] != FREE).sum()) if has_free else ids.shape[0]
            if ids.shape[0] != scores.shape[0]:
                # Counts in full-sequence terms (each sequence-parallel rank holds 1/sp_size of them).
                raise ValueError(
                    f"routing replay, layer {layer}: {ids.shape[0] * sp_size} tokens of expert ids but the "
                    f"model routes {scores.shape[0] * sp_size} (ids must be [s*b, topk], sequence-major, full sequence)"
                )
            ids = ids.to(scores.device)
            want_shadow = self.shadow is not None and not recompute
            if has_free or want_shadow:
                with torch.no_grad():
                    own = default_compute_topk(scores.detach(), topk, num_groups=num_groups, group_topk=group_topk)[1]
                if has_free:
                    ids = torch.where(ids[:, :1] == FREE, own, ids)
                if want_shadow:
                    self.shadow.calls.setdefault(layer, []).append(self._gathered(own))
            return scores.gather(1, ids), ids

        return get_replay_topk

    def _gathered(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.detach()
        if self._sp is not None:
            parts = [torch.empty_like(ids) for _ in range(self._sp.size)]
            dist.all_gather(parts, ids.contiguous(), group=self._sp.group)
            ids = torch.cat(parts)
        return ids.clone()


def check_expert_ids(ids: torch.Tensor, num_experts: int, where: str) -> None:
    """``[tokens, topk]`` ids: each row is :data:`FREE` throughout, or ``topk`` distinct ids in
    ``[0, num_experts)``; ValueError naming the first bad row otherwise."""
    if not ids.numel():
        return
    free = (ids == FREE).all(-1)
    bad = ~free & ((ids < 0) | (ids >= num_experts)).any(-1)
    if bad.any():
        t = int(bad.nonzero()[0, 0])
        raise ValueError(f"{where}: token {t} has expert ids {ids[t].tolist()} outside [0, {num_experts}) "
                         f"(a row of all {FREE} marks a token without routing)")
    srt = ids.sort(-1).values
    dup = ~free & (srt[:, 1:] == srt[:, :-1]).any(-1)
    if dup.any():
        t = int(dup.nonzero()[0, 0])
        raise ValueError(f"{where}: token {t} has repeated expert ids {ids[t].tolist()} (top-k ids must be distinct)")


@contextlib.contextmanager
def replay_routing(built: BuiltModel, topk_ids: Optional[Mapping[int, torch.Tensor]] = None, *,
                   shadow: bool = False) -> Iterator[RoutingReplayer]:
    """Force the routers to the given expert ids during the forwards in the block.

    ``topk_ids`` (``{global layer: [tokens, topk]}``) is set at once if given; with several
    micro-batches call ``replayer.set(...)`` before each forward instead. A token-count mismatch
    between the ids and the router's input raises ValueError. ``shadow``: also record each router's own
    choice (``replayer.shadow``).
    """
    replayer = RoutingReplayer(built, shadow=shadow)
    for layer, _, replay in replayer._routers:
        replay.get_replay_topk = replayer._topk_for(layer)  # instance attribute: shadows the method
    try:
        with _action(built, RouterReplayAction.REPLAY_FORWARD, []):
            if topk_ids is not None:
                replayer.set(topk_ids)
            yield replayer
    finally:
        for _, _, replay in replayer._routers:
            if "get_replay_topk" in vars(replay):
                del replay.get_replay_topk
