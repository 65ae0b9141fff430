"""From the rollout engine's recorded expert ids to the trainer's routing-replay layout, with checks.

The engine returns, per sample, ``prompt_routed_experts [P, L, topk]`` and ``routed_experts [R, L,
topk]`` (row ``t`` = the routing computed at the position holding token ``t`` as input, ``L`` = the
sparse-MoE layers in model order; ``megatron_rl.rollout.client.protocol.Sample``). The trainer wants
``TrainBatch.routed_experts [B, S, num_moe_layers, topk]`` over prompt + response positions, plus
``TrainBatch.route_checksums [B]``: a checksum of the token ids the routes were recorded for, which the
trainer recomputes from each micro-batch's tokens before replaying (a shuffled or mis-split batch then
fails loudly instead of replaying another sequence's routes).

Missing routes. SGLang never feeds the last response token back, so its row is ``-1``. That routing
cannot influence any response log-prob (causal attention: the last position predicts nothing), so the
row stays :data:`FREE` and the trainer's own router routes it. More generally a ``-1`` row is accepted
(as :data:`FREE`) at positions no loss token's log-prob depends on: after the position that predicts
a sequence's last loss token (:func:`attach_routes` reads ``response_mask``; e.g. a masked-out
aborted sample). Anywhere else it raises, naming the sample and position: the engine did not record
routing the loss depends on. Positions past a sequence's end are :data:`FREE` too.

    layout = RoutingLayout.from_arch(load_arch(hf_path))
    batch = TrainBatch.from_sequences(prompts, responses, ...)
    batch = attach_routes(batch, samples, layout)     # routed_experts + route_checksums, checked
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from megatron_rl.models.router import FREE, check_expert_ids
from megatron_rl.rollout.client.protocol import ExpertLayout

Tensor = torch.Tensor
_P = (1 << 31) - 1  # checksum modulus (a Mersenne prime); products stay inside int64
_BASE = 1_000_003


@dataclass(frozen=True)
class RoutingLayout:
    """What the trainer's routers expect: MoE layer count, experts per token, experts per layer."""

    num_moe_layers: int
    topk: int
    num_experts: int

    @classmethod
    def from_arch(cls, arch) -> "RoutingLayout":
        """From a :class:`megatron_rl.models.config.HFArch` (``load_arch(hf_path)``)."""
        if not arch.is_moe:
            raise ValueError(f"routing replay needs an MoE model; {arch.model_type!r} is dense")
        return cls(sum(bool(m) for m in arch.moe_layers), arch.moe_topk, arch.num_experts)


def expert_layout(arch):
    """The engines' view of an MoE model (:class:`~megatron_rl.rollout.client.protocol.ExpertLayout`): which decoder
    layers route (SGLang's routed-experts rows cover every layer) and how many experts per token."""
    return ExpertLayout(tuple(bool(m) for m in arch.moe_layers), arch.moe_topk)


_W = torch.ones(1, dtype=torch.long)


def _weights(n: int) -> Tensor:
    """``_BASE ** t mod _P`` for ``t < n`` (cached, grown by doubling)."""
    global _W
    while _W.numel() < n:
        _W = torch.cat([_W, _W * (_W[-1] * _BASE % _P) % _P])
    return _W[:n]


def token_checksum(input_ids: Tensor) -> Tensor:
    """``[B]`` int64 positional checksum of each row of ``[B, S]`` token ids (or ``[S]`` -> scalar).

    Trailing zeros do not change it, so a right-padded row (micro-batches pad with id 0) has the checksum
    of its unpadded tokens."""
    ids = torch.as_tensor(input_ids).long()
    squeeze = ids.dim() == 1
    ids = ids.reshape(1, -1) if squeeze else ids
    out = ((ids.cpu() % _P) * _weights(ids.shape[1]) % _P).sum(1) % _P
    return out[0] if squeeze else out


def sample_routes(sample, layout: RoutingLayout, index: Optional[int] = None, needed: Optional[int] = None) -> Tensor:
    """``[P + R, num_moe_layers, topk]`` int64 expert ids of one engine sample. Rows ``>= needed`` (default
    ``P + R - 1``: all but the last token) may lack routing and become :data:`FREE`. Raises ValueError
    naming the sample and the mismatching numbers."""
    where = f"sample {index}" if index is not None else "sample"
    P, R = len(sample.prompt_ids), len(sample.response_ids)
    pre, resp = sample.prompt_routed_experts, sample.routed_experts
    if resp is None or pre is None:
        which = "routed_experts" if resp is None else "prompt_routed_experts"
        raise ValueError(f"{where}: no {which} (P={P} prompt, R={R} response tokens); request "
                         "return_routed_experts=True (SGLang: --enable-return-routed-experts)")
    for name, t, rows in (("prompt_routed_experts", pre, P), ("routed_experts", resp, R)):
        t = torch.as_tensor(t)
        if t.dim() != 3:
            raise ValueError(f"{where}: {name} must be [tokens, layers, topk], got shape {tuple(t.shape)}")
        if t.shape[0] != rows:
            raise ValueError(f"{where}: {name} has {t.shape[0]} token rows but the sample has {rows} "
                             f"{'prompt' if rows == P else 'response'} tokens (P={P}, R={R})")
        if t.shape[1] != layout.num_moe_layers:
            raise ValueError(f"{where}: {name} has {t.shape[1]} MoE layers but the trainer's model has "
                             f"{layout.num_moe_layers}")
        if t.shape[2] != layout.topk:
            raise ValueError(f"{where}: {name} has top-k {t.shape[2]} but the trainer's model routes to "
                             f"top-k={layout.topk}")
    ids = torch.cat([torch.as_tensor(pre), torch.as_tensor(resp)]).long()
    needed = P + R - 1 if needed is None else needed
    missing = (ids < 0).all(-1)  # [S, L]: routing never computed
    if missing[:needed].any():
        t, layer = (int(v) for v in missing[:needed].nonzero()[0])
        raise ValueError(f"{where}: no routing for token {t} (of P={P} + R={R}) at MoE layer {layer}; loss log-probs "
                         f"depend on the routing of tokens 0..{needed - 1}")
    tail = ids[needed:]
    ids[needed:] = torch.where((tail < 0).all(-1, keepdim=True), torch.full_like(tail, FREE), tail)
    check_expert_ids(ids.reshape(-1, layout.topk), layout.num_experts, f"{where} routing")
    return ids


def routes_for_samples(samples: Sequence, layout: RoutingLayout) -> List[Tensor]:
    """:func:`sample_routes` of every sample: the ``routed_experts`` items of ``TrainBatch.from_sequences``."""
    return [sample_routes(s, layout, i) for i, s in enumerate(samples)]


def attach_routes(batch, samples: Sequence, layout: RoutingLayout):
    """``batch`` with ``routed_experts`` (``[B, S, layers, topk]``, :data:`FREE` past each sequence) and
    ``route_checksums`` from ``samples``, row ``i`` from ``samples[i]``. Row ``i`` of the batch must hold
    exactly sample ``i``'s prompt + response tokens (else ValueError naming the row, and which sample it
    does hold if any: an order mismatch). Routing may be missing only where no loss token depends on it
    (after the position predicting the row's last ``response_mask`` token)."""
    B, S = batch.input_ids.shape
    if len(samples) != B:
        raise ValueError(f"{len(samples)} samples for a batch of {B} sequences")
    tokens = [list(s.prompt_ids) + list(s.response_ids) for s in samples]
    lengths = batch.seq_lengths.tolist()
    for i, (toks, n) in enumerate(zip(tokens, lengths)):
        if len(toks) != n or batch.input_ids[i, :n].tolist() != toks:
            held = [j for j, t in enumerate(tokens) if len(t) == n and batch.input_ids[i, :n].tolist() == t]
            raise ValueError(f"batch row {i} ({n} tokens) does not hold sample {i} ({len(toks)} tokens)"
                             + (f"; it holds sample {held[0]}: the rows are out of order" if held else ""))
    routed = torch.full((B, S, layout.num_moe_layers, layout.topk), FREE, dtype=torch.long)
    cols = torch.arange(batch.response_mask.shape[1])
    last_loss = torch.where(batch.response_mask, cols, torch.full_like(cols, -1)).max(1).values  # -1: none
    needed = torch.where(last_loss >= 0, batch.prompt_lengths + last_loss, torch.zeros_like(last_loss))
    for i, s in enumerate(samples):
        r = sample_routes(s, layout, i, needed=int(needed[i]))
        routed[i, : r.shape[0]] = r
    sums = torch.stack([token_checksum(torch.tensor(t, dtype=torch.long)) for t in tokens]) if B else None
    return batch.replace(routed_experts=routed, route_checksums=sums)


def check_route_checksums(input_ids: Tensor, checksums: Optional[Tensor], where: str = "") -> None:
    """ValueError if the routes' checksums do not match ``[b, s]`` token ids (trailing zero padding ok)."""
    if checksums is None:
        return
    got = token_checksum(input_ids)
    bad = (got != checksums.cpu()).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"routing replay{where}: the routes of row(s) {bad} were recorded for other token "
                         f"sequences (checksums {checksums[bad].tolist()} != tokens' {got[bad].tolist()}); the "
                         "routed_experts rows are out of order with input_ids")
