"""Which passes over the batch a step needs besides the training step, decided once from the objective.

* ``forward``: the policy's log-probs of the batch under the weights that will be updated (old log-probs):
  the decoupled loss, OTB advantages, the gain diagnostic, the dense KL and a KL penalty in the reward read them.
* ``reference_logits``: the trainer's reference model's logits ride along each forward (the exact KL).
* ``ref_logprobs``: log π_ref of the sampled tokens for a sample-based KL penalty (a separate pass).
* ``gain``: one more forward after the update (``diagnostics.gain``).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.objective import ObjectiveConfig


@dataclass(frozen=True)
class StepPasses:
    forward: bool
    reference_logits: bool
    ref_logprobs: bool
    gain: bool

    @classmethod
    def of(cls, objective: ObjectiveConfig, *, advantage_estimator: str, gain: bool,
           ref_logprobs: bool) -> "StepPasses":
        """``objective``: the step's (the warm-up has its own); ``ref_logprobs``: whether the run's trainer has
        the sample-KL reference (``needs_sample_kl_reference`` of the run's objective)."""
        kl = objective.kl_penalty
        forward = (objective.policy.mode == "decoupled" or advantage_estimator == "otb" or gain
                   or objective.dense_kl.beta > 0 or (kl.coef > 0 and kl.placement == "reward"))
        return cls(forward=forward, reference_logits=objective.needs_reference_logits, ref_logprobs=ref_logprobs,
                   gain=gain)
