"""Routing-aware masking for MoE models: drop tokens or sequences whose expert routing in the trainer
disagrees too much with the rollout engine's.

Input: ``LossInputs.routing_disagreement`` ``[B, T]``, per response token the fraction of MoE layers
whose top-k expert *set* at the position that predicts the token differs between the trainer and the
engine (0 = identical routing, 1 = every layer differs; ``megatron_rl.routing.agreement``). The trainer
computes it from its own routers (with routing replay: the experts each router would have picked
given the replayed upstream routing).

* ``level='token'``: keep a token iff its disagreement ``<= max_disagreement``;
* ``level='sequence'``: keep a sequence iff the mean disagreement over its valid tokens (the fraction of
  disagreeing (token, layer) pairs) ``<= max_disagreement``.

The mask is ANDed with every other rejection (rollout-correction rules, masked IS, TRM, DVP) in
:func:`megatron_rl.objectives.selection.select_tokens`; rejected tokens still count in a ``total``
denominator, like TRM's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_rl.config.objective import ROUTING_MASK_LEVELS as LEVELS  # noqa: F401
from megatron_rl.config.objective import RoutingMaskConfig
from megatron_rl.objectives.reduce import seq_sum_count

Tensor = torch.Tensor




@dataclass
class RoutingMaskResult:
    token_keep: Tensor  # [B, T] (all True at sequence level)
    seq_keep: Tensor  # [B] (all True at token level; empty sequences are kept)
    seq_disagreement: Tensor  # [B] mean disagreement over valid tokens (0 for empty sequences)
    nonempty: Tensor  # [B]


@torch.no_grad()
def routing_mask(disagreement: Optional[Tensor], valid: Tensor, cfg: RoutingMaskConfig,
                 cp_group=None) -> RoutingMaskResult:
    """The routing mask of one micro-batch (sequence statistics reduced over ``cp_group``)."""
    if disagreement is None:
        raise ValueError("objective.routing_mask is enabled but LossInputs.routing_disagreement is missing (the "
                         "trainer fills it from TrainBatch.routed_experts; see megatron_rl.routing)")
    d = disagreement.detach()
    total, count = seq_sum_count(d, valid, cp_group)
    seq_dis = total / count.clamp(min=1)
    nonempty = count > 0
    token_keep = torch.ones_like(valid)
    seq_keep = torch.ones(valid.shape[0], dtype=torch.bool, device=valid.device)
    if cfg.level == "token":
        token_keep = d <= cfg.max_disagreement
    else:
        seq_keep = (seq_dis <= cfg.max_disagreement) | ~nonempty
    return RoutingMaskResult(token_keep, seq_keep, seq_dis, nonempty)
