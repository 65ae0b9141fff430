"""RL objectives as pure functions over typed per-token records (math_spec §a–§f).

Entry point: :func:`rl_loss` ``(LossInputs, ObjectiveConfig, ReduceGroups, Normalizer) -> (loss, metrics)``.

  records.py            LossInputs (padded [B, T] per-token tensors) and sanitisation
  reduce.py             the only collectives: per-sequence sum/mean/max over CP, DP totals, zigzag scans
  divergence.py         k1/k2/k3 and fused per-sequence divergence statistics
  aggregate.py          token_mean / seq_mean_token_sum / seq_mean_token_mean / fixed, total vs kept
  policy_loss.py        PPO clip (asymmetric, dual clip), GSPO, REINFORCE; decoupled and bypass modes
  rollout_correction.py truncated / masked IS (token, sequence), k1/k2/k3 rejection rules (AND), presets
  trm.py, trm_bounds.py Trust Region Masking and the paper's bounds
  routing_mask.py       MoE routing-aware masking (trainer vs rollout expert choices)
  dvp.py                Dynamic Vocabulary Pruning: safe-set rules as vocab-parallel autograd Functions
  dense_kl.py           dense imitation gradient and the future-KL cost-to-go
  kl_penalty.py         KL penalties (in reward or loss) and the entropy bonus
  (config)              the per-component configs and ObjectiveConfig live in megatron_rl/config/objective.py
  selection.py          masks and weights, decided before any differentiable math
  metrics.py            diagnostics with fused reductions
  loss.py               composition, step normaliser
  passes.py             StepPasses: which passes a step needs (forward, reference, gain), from the objective
"""

from megatron_rl.objectives.aggregate import AggregationConfig
from megatron_rl.config.objective import ObjectiveConfig
from megatron_rl.objectives.dense_kl import DenseKLConfig, add_future_kl_cost, dense_kl_per_token, future_kl_cost_to_go
from megatron_rl.objectives.dvp import DVPConfig, PrunedStats, pruned_token_stats
from megatron_rl.objectives.kl_penalty import EntropyBonusConfig, KLPenaltyConfig, kl_in_reward, kl_per_token
from megatron_rl.objectives.loss import Normalizer, rl_loss, step_normalizer
from megatron_rl.objectives.passes import StepPasses
from megatron_rl.objectives.policy_loss import PolicyLossConfig
from megatron_rl.objectives.records import LossInputs
from megatron_rl.objectives.reduce import ReduceGroups
from megatron_rl.objectives.rollout_correction import PRESETS, RejectionRule, RolloutCorrectionConfig
from megatron_rl.objectives.routing_mask import RoutingMaskConfig
from megatron_rl.objectives.selection import Selection, select_tokens
from megatron_rl.objectives.trm import TRMConfig, exact_rollout_kl
from megatron_rl.objectives.trm_bounds import TRMBounds, trm_bounds

__all__ = [
    "AggregationConfig", "DVPConfig", "DenseKLConfig", "EntropyBonusConfig", "KLPenaltyConfig", "LossInputs",
    "Normalizer", "ObjectiveConfig", "PRESETS", "PolicyLossConfig", "PrunedStats", "ReduceGroups", "RejectionRule",
    "RolloutCorrectionConfig", "RoutingMaskConfig", "Selection", "StepPasses", "TRMBounds", "TRMConfig", "add_future_kl_cost",
    "dense_kl_per_token",
    "exact_rollout_kl", "future_kl_cost_to_go", "kl_in_reward", "kl_per_token", "pruned_token_stats", "rl_loss",
    "select_tokens", "step_normalizer", "trm_bounds",
]
