"""The objective's part of the config tree: one small dataclass per component, composed here and
cross-checked (combinations that would double count)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.objectives.aggregate import AggregationConfig
from megatron_rl.objectives.dense_kl import DenseKLConfig
from megatron_rl.objectives.dvp import DVPConfig
from megatron_rl.objectives.kl_penalty import EntropyBonusConfig, KLPenaltyConfig
from megatron_rl.objectives.policy_loss import PolicyLossConfig
from megatron_rl.objectives.rollout_correction import RolloutCorrectionConfig
from megatron_rl.objectives.routing_mask import RoutingMaskConfig
from megatron_rl.objectives.trm import TRMConfig


@dataclass(frozen=True)
class ObjectiveConfig:
    policy: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    trm: TRMConfig = field(default_factory=TRMConfig)
    dvp: DVPConfig = field(default_factory=DVPConfig)
    kl_penalty: KLPenaltyConfig = field(default_factory=KLPenaltyConfig)
    dense_kl: DenseKLConfig = field(default_factory=DenseKLConfig)
    entropy: EntropyBonusConfig = field(default_factory=EntropyBonusConfig)
    routing_mask: RoutingMaskConfig = field(default_factory=RoutingMaskConfig)

    def __post_init__(self) -> None:
        p = self.policy
        if p.mode == "bypass" and p.loss != "reinforce" and self.correction.is_level is not None:
            raise ValueError(
                f"correction.is_level={self.correction.is_level!r} with policy.mode='bypass' and policy.loss="
                f"{p.loss!r}: the PPO ratio π_θ/μ already corrects for μ, IS weights would double count "
                "(math_spec §e.1). Set correction.is_level=None (rejection rules still apply) or "
                "policy.loss='reinforce'"
            )
        if self.dense_kl.beta > 0 and self.kl_penalty.in_loss and self.kl_penalty.estimator == "exact":
            raise ValueError(
                "dense_kl.beta > 0 and kl_penalty (estimator='exact', placement='loss') add the same exact KL term "
                "twice; keep one of them (set kl_penalty.coef=0 or dense_kl.beta=0)"
            )
