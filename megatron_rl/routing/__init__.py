"""MoE rollout routing replay: align the engine's expert choices with the trainer, measure agreement,
feed routing-aware masking.

  align.py      engine samples -> ``TrainBatch.routed_experts`` / ``route_checksums``, with checks
  agreement.py  per-layer agreement, per-token disagreement, log-prob mismatch sums
  config.py     RoutingDiagnosticsConfig (``TrainConfig.routing_diagnostics``)

The PolicyTrainer's glue (replay contexts for every pass, metrics, the mask's input) is
:mod:`megatron_rl.training.routing`. The replay mechanics (forcing Megatron's routers, recompute, sequence parallelism) live in
:mod:`megatron_rl.models.router`; the mask in :mod:`megatron_rl.objectives.routing_mask`.
"""

from megatron_rl.models.router import FREE
from megatron_rl.routing.agreement import AgreementTracker, mismatch_metrics, mismatch_sums, same_sets
from megatron_rl.routing.align import (
    RoutingLayout, attach_routes, check_route_checksums, routes_for_samples, sample_routes, token_checksum,
)
from megatron_rl.config.sections import RoutingDiagnosticsConfig

__all__ = [
    "FREE", "AgreementTracker", "RoutingDiagnosticsConfig", "RoutingLayout", "attach_routes", "check_route_checksums",
    "mismatch_metrics", "mismatch_sums", "routes_for_samples", "same_sets", "sample_routes", "token_checksum",
]
