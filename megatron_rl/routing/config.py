"""The trainer's MoE routing diagnostics config (``TrainConfig.routing_diagnostics``).

Replay itself is ``TrainConfig.routing_replay``; routing-aware masking is ``objective.routing_mask``
(:class:`megatron_rl.objectives.RoutingMaskConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingDiagnosticsConfig:
    """MoE routing metrics (batches that carry ``routed_experts``).

    Attributes:
        agreement: per-layer routing agreement with the rollout engine in every ``train_step`` and
            ``forward`` (``routing/agreement_layer{i}``, ``routing/agreement_mean``). Costs no forward: with
            replay each router's own top-k is computed next to the replayed one.
        without_replay: with ``routing_replay`` on, one extra forward-only pass per train step *without*
            replay, before the update: ``routing/no_replay/agreement_*``, ``routing/no_replay/mismatch_k3``
            and ``routing/no_replay/logprob_abs_diff``, next to the with-replay ``routing/mismatch_k3`` and
            ``routing/logprob_abs_diff``. Off by default (a forward per step); turn it on for diagnostics runs.
    """

    agreement: bool = True
    without_replay: bool = False
