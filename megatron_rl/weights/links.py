"""Weight sync on every link: each trainer rank sends the pieces it owns (``models/shards.py``) straight to
the rank that talks to the engine, concurrently; that side assembles. No all-gather, no rank that sees every
tensor before the engine does.

Why (measured, ``tools/bench_weight_sync.py``, 2-core CPU, gloo): at TP=2 the old export spent ~80 % of
the sync in ``all_gather`` (gloo's all-gather of MB-sized tensors: ~0.25 GB/s, its point-to-point
send/recv: 2-4 GB/s, a ``copy_``: ~12 GB/s) and most of the rest in ``torch.cat`` / QKV splitting into
full tensors every rank then dropped. Here each byte crosses one link once, in the engine's dtype (cast
by its owner), and lands where it is used:

* :func:`receive_into` (an in-process ``EmbeddedEngine``): every piece is received straight into its box of
  the engine's parameter when that box is contiguous (row ranges: vocab, q/k/v, gate/up), else into a
  bounded scratch buffer and copied (column ranges of row-parallel weights); the sender's own pieces are
  copied while the peers' are in flight.
* :func:`assemble_stream` (any other engine: HTTP, SGLang's broadcast): the full HF tensors are assembled
  on the sender from the pieces, in export order, and streamed into the engine's buckets as before (SGLang
  loads full HF tensors from a ``broadcast(src=0)``, so its side cannot assemble TP shards itself).

Every rank learns the layout once (:func:`exchange_plan`: who sends which pieces, the engine's dtype);
peers then only ``send``. The sender posts every receive even after an error, so no peer is left blocked.
"""

from __future__ import annotations

import datetime
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_rl.models import mapping
from megatron_rl.models.shards import Piece, owned_pieces
from megatron_rl.weights.deadline import TrainerStalled


@dataclass
class Plan:
    pieces: List[List[Piece]]  # per group rank, in that rank's send order
    ranks: List[int]  # group rank -> global rank
    dtype: torch.dtype  # the engine's, chosen by the sender
    direct: bool  # the sender's engine assembles in place (receive_into) rather than taking full tensors

    def link_bytes(self, rank: int) -> int:
        return sum(p.numel for p in self.pieces[rank]) * torch.empty((), dtype=self.dtype).element_size()


def exchange_plan(built, group, sender: int, dtype: Optional[torch.dtype], direct: bool) -> Plan:
    """Collective: every rank's piece list, the sender's ``dtype`` and ``direct``."""
    mine = ([p for p, _ in owned_pieces(built)], (dtype, direct))
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    gathered = [mine]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, mine, group=group)
    ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(world)]
    dtype, direct = gathered[sender][1]
    return Plan([g[0] for g in gathered], ranks, dtype, direct)


def send_pieces(built, plan: Plan, dst: int, group) -> Tuple[int, float]:
    """A peer's part: its pieces, cast to the engine dtype, in plan order, to global rank ``dst``.
    Returns (bytes, seconds)."""
    start, sent = time.perf_counter(), 0
    for _, t in owned_pieces(built):
        t = t.to(plan.dtype).contiguous()
        dist.send(t, dst=dst, group=group)
        sent += t.numel() * t.element_size()
    return sent, time.perf_counter() - start


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


class _Inbox:
    """The sender's receives from every peer, interleaved across peers so that every link stays busy, with at
    most ``max_scratch`` bytes of scratch buffers pending. ``dst(piece)`` is where the piece goes (a view) or
    None (error: received and dropped); ``done(piece, buf)`` is called with a scratch buffer once it has
    arrived (a piece received in place needs nothing)."""

    def __init__(self, plan: Plan, me: int, group, max_scratch: int, device: torch.device):
        self.plan, self.group, self.max_scratch, self.device = plan, group, max_scratch, device
        queues = [deque(ps) for r, ps in enumerate(plan.pieces) if r != me]
        self.src = [r for r, ps in enumerate(plan.pieces) if r != me]
        self.order: List[Tuple[int, Piece]] = []
        while any(queues):  # round-robin over peers
            for r, q in zip(self.src, queues):
                if q:
                    self.order.append((r, q.popleft()))

    def run(self, dst: Callable[[Piece], Optional[torch.Tensor]], done: Callable[[Piece, torch.Tensor], None],
            between: Callable[[], None] = lambda: None) -> None:
        pending: deque = deque()
        scratch = 0
        between_done = False

        def finish_one():
            nonlocal scratch
            r, piece, buf, work, nbytes, copy = pending.popleft()
            work.wait()
            if copy:
                done(piece, buf)
            scratch -= nbytes

        for r, piece in self.order:
            view = dst(piece)
            in_place = view is not None and view.is_contiguous() and view.dtype == self.plan.dtype
            buf = view if in_place else torch.empty(piece.piece_shape, dtype=self.plan.dtype,
                                                    device=self.device if view is None else view.device)
            nbytes = 0 if in_place else buf.numel() * buf.element_size()
            while pending and nbytes and scratch + nbytes > self.max_scratch:
                if not between_done:
                    between()
                    between_done = True
                finish_one()
            pending.append((r, piece, buf, dist.irecv(buf, src=self.plan.ranks[r], group=self.group), nbytes,
                            view is not None and not in_place))
            scratch += nbytes
        if not between_done:
            between()  # the sender's own pieces, while the peers' are in flight
        while pending:
            finish_one()


def receive_into(built, plan: Plan, me: int, group, target, max_scratch: int) -> None:
    """The sender's part for an in-place engine: ``target`` (``HFWeightTarget``, or None after an error: then
    everything is received and dropped) gets every piece. Raises the first target error once every receive
    has completed."""
    errors: List[BaseException] = []

    def dst(piece: Piece) -> Optional[torch.Tensor]:
        if target is None or errors:
            return None
        try:
            return target.slot(piece.name, piece.shape)[piece.index]
        except Exception as e:  # noqa: BLE001 - raised after the drain
            errors.append(e)
            return None

    def copy_own() -> None:
        for piece, t in owned_pieces(built):
            view = dst(piece)
            if view is not None:
                view.copy_(t)

    with torch.no_grad():
        _Inbox(plan, me, group, max_scratch, _device(built)).run(dst, lambda piece, buf: dst(piece).copy_(buf),
                                                                 copy_own)
    if errors:
        raise errors[0]


def assemble_stream(built, plan: Plan, me: int, group, deadline=None) -> Iterator[Tuple[str, torch.Tensor]]:
    """The sender's part for an engine that takes full HF tensors: ``(name, tensor)`` in export order, each
    assembled from its owners' pieces (a tensor the sender owns whole is yielded as is, maybe a view of the
    parameter). Must be consumed to the end: the peers are sending. ``deadline`` (a ``weights.deadline.Deadline``):
    a peer's piece not received by then raises ``SyncTimeout`` naming that rank (a stalled trainer rank)."""
    own = owned_pieces(built)
    queues = [deque(ps) for ps in plan.pieces]
    present = {p.name for ps in plan.pieces for p in ps}
    device = _device(built)  # the trainer's: where its collectives run (gloo: CPU, NCCL: its GPU)
    for unit in mapping.units(built.arch):
        for name, shape in unit.hf if unit.export else ():
            if name not in present:
                continue
            parts = [(r, q.popleft()) for r, q in enumerate(queues) for _ in range(_count_front(q, name))]
            if len(parts) == 1 and parts[0][0] == me and parts[0][1].whole:
                yield name, _cast(next(own)[1], plan.dtype)
                continue
            out = torch.empty(shape, dtype=plan.dtype, device=device)
            works = []
            for r, piece in parts:
                view = out[piece.index]
                if r == me:
                    view.copy_(next(own)[1])
                    continue
                buf = view if view.is_contiguous() else torch.empty(piece.piece_shape, dtype=plan.dtype, device=device)
                works.append((dist.irecv(buf, src=plan.ranks[r], group=group), view, buf))
            for (work, view, buf), (r, _) in zip(works, [p for p in parts if p[0] != me]):
                _wait(work, deadline, plan.ranks[r], name)
                if buf is not view:
                    view.copy_(buf)
            yield name, out


def _wait(work, deadline, rank: int, name: str) -> None:
    """``work.wait()``, bounded by ``deadline`` (gloo and NCCL both end a wait that times out with an error)."""
    if deadline is None:
        work.wait()
        return
    try:
        work.wait(datetime.timedelta(seconds=deadline.bound()))
    except RuntimeError as e:
        if not deadline.expired:
            raise
        raise TrainerStalled(f"{deadline.what}: trainer rank {rank} did not send its piece of {name} within the deadline "
                          f"of {deadline.seconds:.1f} s (rollout.weights.sync.timeout_s): a stalled trainer rank; the "
                          f"trainer's process group is unusable after this ({e})") from None


def _device(built) -> torch.device:
    return next(built.module.parameters()).device


def _count_front(q: deque, name: str) -> int:
    n = 0
    while n < len(q) and q[n].name == name:
        n += 1
    return n
