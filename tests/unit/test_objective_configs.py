"""Every config dataclass rejects bad values with a ValueError naming the field and the value."""

import pytest

from megatron_rl.advantages import AdvantageConfig
from megatron_rl.objectives import (
    AggregationConfig, DenseKLConfig, DVPConfig, EntropyBonusConfig, KLPenaltyConfig, ObjectiveConfig,
    PolicyLossConfig, RejectionRule, RolloutCorrectionConfig, TRMConfig,
)
from megatron_rl.lr_schedules import LRScheduleConfig

BAD = [
    (lambda: PolicyLossConfig(loss="ppo"), "PolicyLossConfig.loss='ppo'"),
    (lambda: PolicyLossConfig(mode="offpolicy"), "PolicyLossConfig.mode"),
    (lambda: PolicyLossConfig(clip_eps_low=1.0), "clip_eps_low=1.0"),
    (lambda: PolicyLossConfig(clip_eps_high=-0.1), "clip_eps_high=-0.1"),
    (lambda: PolicyLossConfig(dual_clip_c=1.0), "dual_clip_c=1.0"),
    (lambda: AggregationConfig(mode="sum"), "AggregationConfig.mode='sum'"),
    (lambda: AggregationConfig(denominator="all"), "AggregationConfig.denominator='all'"),
    (lambda: AggregationConfig(mode="fixed"), "fixed_denominator=None"),
    (lambda: AggregationConfig(fixed_denominator=4.0), "fixed_denominator=4.0"),
    (lambda: RejectionRule("k4", "token", upper=1.0), "statistic"),
    (lambda: RejectionRule("k2", "seq", upper=1.0), "level"),
    (lambda: RejectionRule("k1", "seq_max", 0.5, 2.0), "seq_max"),
    (lambda: RejectionRule("k1", "token"), "lower and/or upper"),
    (lambda: RejectionRule("k1", "token", 2.0, 0.5), "lower=2.0"),
    (lambda: RejectionRule("k1", "token", -1.0, 0.5), "> 0"),
    (lambda: RejectionRule("k2", "token", lower=0.1, upper=1.0), "lower=0.1"),
    (lambda: RejectionRule("k3", "seq_mean"), "upper=None"),
    (lambda: RolloutCorrectionConfig(is_level="seq"), "is_level='seq'"),
    (lambda: RolloutCorrectionConfig(is_mode="clip"), "is_mode='clip'"),
    (lambda: RolloutCorrectionConfig(is_upper=0.0), "is_upper=0.0"),
    (lambda: RolloutCorrectionConfig(is_level="token", is_lower=0.5), "is_lower=0.5"),
    (lambda: RolloutCorrectionConfig(is_level="token", is_mode="mask", is_lower=3.0), "is_lower=3.0"),
    (lambda: RolloutCorrectionConfig(is_batch_normalize=True), "is_batch_normalize"),
    (lambda: RolloutCorrectionConfig(rejection=("seq_max_k2",)), "RejectionRule"),
    (lambda: TRMConfig(max_kl=0.0), "max_kl=0.0"),
    (lambda: TRMConfig(avg_kl=-1.0), "avg_kl=-1.0"),
    (lambda: TRMConfig(divergence="k2"), "divergence='k2'"),
    (lambda: DVPConfig(rule="nucleus"), "rule='nucleus'"),
    (lambda: DVPConfig(min_p=1.0), "min_p=1.0"),
    (lambda: DVPConfig(top_k=0), "top_k=0"),
    (lambda: DVPConfig(top_p=0.0), "top_p=0.0"),
    (lambda: DVPConfig(abs_logprob=0.5), "abs_logprob=0.5"),
    (lambda: DVPConfig(out_of_set="drop"), "out_of_set='drop'"),
    (lambda: DVPConfig(bisection_iters=0), "bisection_iters=0"),
    (lambda: KLPenaltyConfig(coef=-1.0), "coef=-1.0"),
    (lambda: KLPenaltyConfig(estimator="k4"), "estimator='k4'"),
    (lambda: KLPenaltyConfig(placement="both"), "placement='both'"),
    (lambda: EntropyBonusConfig(coef=-0.1), "coef=-0.1"),
    (lambda: DenseKLConfig(beta=-1.0), "beta=-1.0"),
    (lambda: DenseKLConfig(direction="js"), "direction='js'"),
    (lambda: ObjectiveConfig(policy=PolicyLossConfig(mode="bypass"), correction=RolloutCorrectionConfig(is_level="token")),
     "double count"),
    (lambda: ObjectiveConfig(dense_kl=DenseKLConfig(beta=0.1), kl_penalty=KLPenaltyConfig(coef=0.1, estimator="exact")),
     "twice"),
    (lambda: AdvantageConfig(estimator="ppo"), "estimator='ppo'"),
    (lambda: AdvantageConfig(gamma=0.0), "gamma=0.0"),
    (lambda: AdvantageConfig(otb_align="turn"), "otb_align='turn'"),
    (lambda: AdvantageConfig(rtg_baseline="median"), "rtg_baseline='median'"),
    (lambda: LRScheduleConfig(kind="linear"), "kind='linear'"),
    (lambda: LRScheduleConfig(lr=0.0), "lr=0.0"),
    (lambda: LRScheduleConfig(kind="cosine"), "total_steps=None"),
    (lambda: LRScheduleConfig(surge_factor=1.0), "surge_factor=1.0"),
    (lambda: LRScheduleConfig(decay_factor=1.0), "decay_factor=1.0"),
    (lambda: LRScheduleConfig(decay_shape="linear"), "decay_shape='linear'"),
    (lambda: LRScheduleConfig(min_lr=2.0, lr=1.0), "min_lr=2.0"),
]


@pytest.mark.parametrize("make,fragment", BAD, ids=[b[1] for b in BAD])
def test_invalid_config_names_field_and_value(make, fragment):
    with pytest.raises(ValueError) as e:
        make()
    assert fragment in str(e.value)


def test_defaults_are_valid():
    for cls in (PolicyLossConfig, AggregationConfig, RolloutCorrectionConfig, TRMConfig, DVPConfig, KLPenaltyConfig,
                EntropyBonusConfig, DenseKLConfig, ObjectiveConfig, AdvantageConfig, LRScheduleConfig):
        cls()
