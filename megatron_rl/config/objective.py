"""The objective's part of the config tree: one small dataclass per component (policy loss, aggregation, rollout
correction, TRM, DVP, KL penalty, dense KL, entropy bonus, routing mask), composed and cross-checked in
:class:`ObjectiveConfig` (combinations that would double count). Plain data: the loss code in
:mod:`megatron_rl.objectives` imports these, never the other way round, so the config tree loads without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Literal, Optional, Tuple, Union

LOSSES = ("ppo_clip", "gspo", "reinforce")


POLICY_MODES = ("decoupled", "bypass")


@dataclass(frozen=True)
class PolicyLossConfig:
    """Policy-gradient surrogate.

    Attributes:
        loss: ``ppo_clip`` (token ratio), ``gspo`` (sequence geometric-mean ratio, token gradient) or
            ``reinforce`` (``−sg(w)·A·log π_θ``; one gradient step per batch). GSPO's gradient is that of
            the sequence objective with aggregation ``seq_mean_token_mean`` (the GSPO paper's choice).
        mode: ``decoupled`` — three policies: PPO ratio π_θ/π_old, rollout correction on π_old/μ
            (needs ``old_logprobs``); ``bypass`` — π_old := μ, no recompute: PPO ratio π_θ/μ and
            correction statistics from sg(π_θ)/μ (needs ``rollout_logprobs``).
        clip_eps_low / clip_eps_high: ratio clipped to [1−ε_low, 1+ε_high] ("clip-higher" when
            ε_high > ε_low). GSPO uses sequence-level ε (typically 3e-4 / 4e-4).
        dual_clip_c: for A < 0 the loss is capped at c·|A| (dual clip, c > 1); ``None`` disables.
            ``"auto"`` (default) resolves to 3.0 for ``ppo_clip`` (verl) and to ``None`` for ``gspo``
            (GSPO's sequence-level clip has no dual clip; set a number to ask for one).
    """

    loss: str = "ppo_clip"
    mode: str = "decoupled"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: Union[float, Literal["auto"], None] = "auto"

    def __post_init__(self) -> None:
        if self.dual_clip_c == "auto":
            object.__setattr__(self, "dual_clip_c", 3.0 if self.loss == "ppo_clip" else None)
        elif isinstance(self.dual_clip_c, str):
            raise ValueError(f"PolicyLossConfig.dual_clip_c={self.dual_clip_c!r}: expected a number > 1, None or 'auto'")
        if self.loss not in LOSSES:
            raise ValueError(f"PolicyLossConfig.loss={self.loss!r} is not one of {LOSSES}")
        if self.mode not in POLICY_MODES:
            raise ValueError(f"PolicyLossConfig.mode={self.mode!r} is not one of {POLICY_MODES}")
        if not 0 <= self.clip_eps_low < 1:
            raise ValueError(f"PolicyLossConfig.clip_eps_low={self.clip_eps_low} must be in [0, 1) "
                             "(the lower clip bound 1-eps must stay positive)")
        if not self.clip_eps_high >= 0:
            raise ValueError(f"PolicyLossConfig.clip_eps_high={self.clip_eps_high} must be >= 0")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1:
            raise ValueError(f"PolicyLossConfig.dual_clip_c={self.dual_clip_c} must be > 1 (verl uses 3.0) or None")


AGGREGATION_MODES = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "fixed")


DENOMINATORS = ("total", "kept")


@dataclass(frozen=True)
class AggregationConfig:
    """How per-token terms are reduced to the loss.

    Attributes:
        mode: one of ``token_mean``, ``seq_mean_token_sum``, ``seq_mean_token_mean``, ``fixed``.
        denominator: ``total`` (rejected tokens/sequences still count) or ``kept`` (they do not).
        fixed_denominator: the constant D of mode ``fixed`` (required there, forbidden elsewhere).
    """

    mode: str = "token_mean"
    denominator: str = "total"
    fixed_denominator: Optional[float] = None

    def __post_init__(self) -> None:
        if self.mode not in AGGREGATION_MODES:
            raise ValueError(f"AggregationConfig.mode={self.mode!r} is not one of {AGGREGATION_MODES}")
        if self.denominator not in DENOMINATORS:
            raise ValueError(f"AggregationConfig.denominator={self.denominator!r} is not one of {DENOMINATORS}")
        if self.mode == "fixed":
            if self.fixed_denominator is None or not self.fixed_denominator > 0:
                raise ValueError(
                    f"AggregationConfig.fixed_denominator={self.fixed_denominator!r}: mode 'fixed' needs a positive "
                    "constant, e.g. global batch size × max response length (Dr.GRPO)"
                )
        elif self.fixed_denominator is not None:
            raise ValueError(
                f"AggregationConfig.fixed_denominator={self.fixed_denominator!r} is only used by mode 'fixed'; "
                f"remove it or set mode='fixed' (mode is {self.mode!r})"
            )


STATISTICS = ("k1", "k2", "k3")


CORRECTION_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")


@dataclass(frozen=True)
class RejectionRule:
    """Keep a token/sequence only if its statistic lies within the bounds. Rules are AND-ed.

    ``k1``: ``lower``/``upper`` bound the *ratio* (token ρ_t for ``token``, ρ(y) for ``seq_sum``,
    ρ_geo for ``seq_mean``); either may be omitted for a one-sided test. ``k2``/``k3``: ``upper``
    bounds the statistic (per token, its sequence sum, mean or max); ``lower`` must be ``None``.
    """

    statistic: str
    level: str
    lower: Optional[float] = None
    upper: Optional[float] = None

    def __post_init__(self) -> None:
        name = f"RejectionRule({self.statistic!r}, {self.level!r})"
        if self.statistic not in STATISTICS:
            raise ValueError(f"{name}: statistic must be one of {STATISTICS}")
        if self.level not in CORRECTION_LEVELS:
            raise ValueError(f"{name}: level must be one of {CORRECTION_LEVELS}")
        if self.statistic == "k1":
            if self.level == "seq_max":
                raise ValueError(f"{name}: 'seq_max' is defined for k2/k3 only; bound every token's ratio with "
                                 "level='token' or use ('k2', 'seq_max') for a |log ρ| veto")
            if self.lower is None and self.upper is None:
                raise ValueError(f"{name}: give a ratio bound lower and/or upper (e.g. lower=0.5, upper=2.0)")
            for b in (self.lower, self.upper):
                if b is not None and not b > 0:
                    raise ValueError(f"{name}: ratio bounds must be > 0, got lower={self.lower} upper={self.upper}")
            if self.lower is not None and self.upper is not None and not self.lower < self.upper:
                raise ValueError(f"{name}: lower={self.lower} must be < upper={self.upper}")
        else:
            if self.lower is not None:
                raise ValueError(f"{name}: lower={self.lower} is not used by {self.statistic} (a divergence >= 0); "
                                 "set only upper")
            if self.upper is None or not self.upper > 0:
                raise ValueError(f"{name}: upper={self.upper} must be a positive bound on the statistic")

    @property
    def name(self) -> str:
        return f"{self.level}_{self.statistic}"

    @classmethod
    def parse(cls, option: str, threshold: str) -> "RejectionRule":
        """From a verl-style pair, e.g. ``("seq_max_k2", "2.5")`` or ``("token_k1", "0.6_1.6")``.

        k1 thresholds ``"lo_hi"`` are read as bounds on ρ (see module docstring); a single float u means
        [1/u, u], as in verl.
        """
        level, _, stat = option.rpartition("_")
        if stat == "k1":
            parts = [float(p) for p in str(threshold).split("_")]
            lo, hi = (1.0 / parts[0], parts[0]) if len(parts) == 1 else (parts[0], parts[1])
            return cls(stat, level, lo, hi)
        return cls(stat, level, None, float(threshold))


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Importance weights and rejection sampling for the rollout → trainer mismatch.

    Attributes:
        is_level: ``None`` (no weights), ``token`` or ``sequence``.
        is_mode: ``truncate`` (w = min(ρ, is_upper)) or ``mask`` (w = ρ inside [is_lower, is_upper],
            rejected outside).
        is_upper: C (truncation cap, or the upper bound of the mask). verl default 2.0.
        is_lower: lower bound of ``mask`` mode (``None`` = one-sided, the original MIS); unused by
            ``truncate``.
        is_batch_normalize: divide the weights by their mean over surviving tokens (token level) or
            sequences (sequence level) of the whole step; skipped when that mean is <= 1e-8.
        rejection: rules, AND-ed.
    """

    is_level: Optional[str] = None
    is_mode: str = "truncate"
    is_upper: float = 2.0
    is_lower: Optional[float] = None
    is_batch_normalize: bool = False
    rejection: Tuple[RejectionRule, ...] = ()

    def __post_init__(self) -> None:
        if self.is_level not in (None, "token", "sequence"):
            raise ValueError(f"RolloutCorrectionConfig.is_level={self.is_level!r} must be None, 'token' or 'sequence'")
        if self.is_mode not in ("truncate", "mask"):
            raise ValueError(f"RolloutCorrectionConfig.is_mode={self.is_mode!r} must be 'truncate' or 'mask'")
        if not self.is_upper > 0:
            raise ValueError(f"RolloutCorrectionConfig.is_upper={self.is_upper} must be > 0 (typical 2.0)")
        if self.is_lower is not None:
            if self.is_mode != "mask":
                raise ValueError(f"RolloutCorrectionConfig.is_lower={self.is_lower} is only used with is_mode='mask'")
            if not 0 <= self.is_lower < self.is_upper:
                raise ValueError(f"RolloutCorrectionConfig.is_lower={self.is_lower} must be in [0, is_upper="
                                 f"{self.is_upper})")
        if self.is_batch_normalize and self.is_level is None:
            raise ValueError("RolloutCorrectionConfig.is_batch_normalize=True needs is_level 'token' or 'sequence'")
        rules = tuple(self.rejection)
        if any(not isinstance(r, RejectionRule) for r in rules):
            raise ValueError("RolloutCorrectionConfig.rejection must hold RejectionRule objects "
                             "(RejectionRule.parse('seq_max_k2', '2.5') converts verl strings)")
        object.__setattr__(self, "rejection", rules)

    @property
    def active(self) -> bool:
        return self.is_level is not None or bool(self.rejection)


PRESETS: Dict[str, RolloutCorrectionConfig] = {
    "token_tis": RolloutCorrectionConfig(is_level="token", is_upper=2.0),
    "seq_tis": RolloutCorrectionConfig(is_level="sequence", is_upper=2.0),
    "icepop": RolloutCorrectionConfig(is_level="token", is_mode="mask", is_lower=0.5, is_upper=2.0),
    "seq_mis": RolloutCorrectionConfig(is_level="sequence", is_mode="mask", is_lower=0.5, is_upper=2.0),
    "geo_rs": RolloutCorrectionConfig(rejection=(RejectionRule("k1", "seq_mean", 0.999, 1.001),)),
    "k3_rs": RolloutCorrectionConfig(rejection=(RejectionRule("k3", "seq_mean", upper=0.01),)),
    "geo_rs_token_tis": RolloutCorrectionConfig(is_level="token", is_upper=2.0,
                                                rejection=(RejectionRule("k1", "seq_mean", 0.999, 1.001),)),
}


DIVERGENCES = ("auto", "exact", "sample")


@dataclass(frozen=True)
class TRMConfig:
    """Trust Region Masking.

    Attributes:
        enabled: apply the sequence mask.
        max_kl: δ of the max criterion (paper: 0.05).
        avg_kl: δ_avg of the optional mean criterion (paper: 0.001); ``None`` disables it.
        divergence: ``exact`` (needs ``LossInputs.rollout_kl``), ``sample`` (k2 / k3 from the sampled
            token's log-ratio), or ``auto`` (exact when ``rollout_kl`` is given).
        log_bounds: report the paper's bounds (classical, Pinsker-Marginal, Mixed, Coupling, min) for
            this batch's divergences as metrics.
    """

    enabled: bool = False
    max_kl: float = 0.05
    avg_kl: Optional[float] = None
    divergence: str = "auto"
    log_bounds: bool = True

    def __post_init__(self) -> None:
        if not self.max_kl > 0:
            raise ValueError(f"TRMConfig.max_kl={self.max_kl} must be > 0 (paper: 0.05)")
        if self.avg_kl is not None and not self.avg_kl > 0:
            raise ValueError(f"TRMConfig.avg_kl={self.avg_kl} must be > 0 (paper: 0.001) or None")
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"TRMConfig.divergence={self.divergence!r} is not one of {DIVERGENCES}")


RULES = ("min_p", "top_k", "top_p", "abs_logprob")


OUT_OF_SET = ("force_include", "mask")


@dataclass(frozen=True)
class DVPConfig:
    """Dynamic vocabulary pruning.

    Attributes:
        enabled: use pruned log-probs (the trainer must compute *every* log-prob of a ratio with the same
            rule, and the engine must return renormalised log μ_K).
        rule: safe-set rule, one of ``min_p`` (default: cheapest under TP, native in SGLang), ``top_k``,
            ``top_p``, ``abs_logprob``.
        min_p: keep v with π_v >= min_p · max_u π_u.
        top_k: keep the k largest logits.
        top_p: keep the smallest nucleus with mass >= top_p.
        abs_logprob: keep v with log π_v >= abs_logprob (a negative number).
        out_of_set: a sampled token outside the trainer's set K: ``force_include`` (add it to the
            normaliser: log π_{K∪{y}}) or ``mask`` (reject the token; counted either way).
        bisection_iters: top-p threshold search iterations (48 resolve logits ~1e-13 apart).
    """

    enabled: bool = False
    rule: str = "min_p"
    min_p: float = 1e-3
    top_k: int = 64
    top_p: float = 0.99
    abs_logprob: float = -12.0
    out_of_set: str = "force_include"
    bisection_iters: int = 48

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"DVPConfig.rule={self.rule!r} is not one of {RULES}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"DVPConfig.min_p={self.min_p} must be in [0, 1) (e.g. 1e-3)")
        if not self.top_k >= 1:
            raise ValueError(f"DVPConfig.top_k={self.top_k} must be >= 1")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"DVPConfig.top_p={self.top_p} must be in (0, 1]")
        if not self.abs_logprob < 0:
            raise ValueError(f"DVPConfig.abs_logprob={self.abs_logprob} must be < 0 (a log-probability)")
        if self.out_of_set not in OUT_OF_SET:
            raise ValueError(f"DVPConfig.out_of_set={self.out_of_set!r} is not one of {OUT_OF_SET}")
        if not 1 <= self.bisection_iters <= 200:
            raise ValueError(f"DVPConfig.bisection_iters={self.bisection_iters} must be in [1, 200]")


ESTIMATORS = ("k1", "k2", "k3", "low_var", "exact")


PLACEMENTS = ("loss", "reward")


@dataclass(frozen=True)
class KLPenaltyConfig:
    """β·KL(π_θ ‖ π_ref) penalty.

    Attributes:
        coef: β (0 disables).
        estimator: ``k1``, ``k2``, ``k3``, ``low_var`` or ``exact``.
        placement: ``loss`` (added to the per-token loss) or ``reward`` (subtracted from the per-token
            reward before the advantage estimator; see :func:`kl_in_reward`).
    """

    coef: float = 0.0
    estimator: str = "low_var"
    placement: str = "loss"

    def __post_init__(self) -> None:
        if not self.coef >= 0:
            raise ValueError(f"KLPenaltyConfig.coef={self.coef} must be >= 0")
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"KLPenaltyConfig.estimator={self.estimator!r} is not one of {ESTIMATORS}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"KLPenaltyConfig.placement={self.placement!r} is not one of {PLACEMENTS}")

    @property
    def in_loss(self) -> bool:
        return self.coef > 0 and self.placement == "loss"


@dataclass(frozen=True)
class EntropyBonusConfig:
    """Entropy bonus: ``−coef · H(π_θ(·|c_t))`` per token (needs ``LossInputs.entropy``)."""

    coef: float = 0.0

    def __post_init__(self) -> None:
        if not self.coef >= 0:
            raise ValueError(f"EntropyBonusConfig.coef={self.coef} must be >= 0")


@dataclass(frozen=True)
class DenseKLConfig:
    """Dense imitation term.

    Attributes:
        beta: β (0 disables).
        direction: ``reverse`` = KL(π_θ‖π_ref), the gradient of the trajectory KL (§c.2); ``forward`` =
            KL(π_ref‖π_θ) on student contexts, a surrogate (not the gradient of a trajectory KL, §c.3).
        sparse_includes_future_kl: subtract β Σ_{t'>t} κ_{t'} from the sparse advantage (exact gradient).
    """

    beta: float = 0.0
    direction: str = "reverse"
    sparse_includes_future_kl: bool = True

    def __post_init__(self) -> None:
        if not self.beta >= 0:
            raise ValueError(f"DenseKLConfig.beta={self.beta} must be >= 0")
        if self.direction not in ("reverse", "forward"):
            raise ValueError(f"DenseKLConfig.direction={self.direction!r} must be 'reverse' or 'forward'")


ROUTING_MASK_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class RoutingMaskConfig:
    """Routing-aware masking.

    Attributes:
        enabled: apply the mask (needs ``LossInputs.routing_disagreement``).
        max_disagreement: the largest tolerated disagreement fraction, in ``[0, 1)`` (0: any differing
            layer rejects).
        level: ``token`` or ``sequence`` (see the module docstring).
    """

    enabled: bool = False
    max_disagreement: float = 0.1
    level: str = "sequence"

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_disagreement < 1.0:
            raise ValueError(f"RoutingMaskConfig.max_disagreement={self.max_disagreement} must be in [0, 1) "
                             "(1 would keep everything: disable the mask instead)")
        if self.level not in ROUTING_MASK_LEVELS:
            raise ValueError(f"RoutingMaskConfig.level={self.level!r} is not one of {ROUTING_MASK_LEVELS}")


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

    @property
    def needs_reference_logits(self) -> bool:
        """The exact per-token KL to a reference policy: the dense KL or an exact KL penalty in the loss."""
        kl = self.kl_penalty
        return self.dense_kl.beta > 0 or (kl.in_loss and kl.estimator == "exact")

    @property
    def needs_sample_kl_reference(self) -> bool:
        """A sample-based KL penalty: log π_ref of the sampled tokens, from the reference model's own pass."""
        kl = self.kl_penalty
        return kl.coef > 0 and kl.estimator != "exact"
