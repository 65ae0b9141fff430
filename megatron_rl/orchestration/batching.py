"""From scored rollout groups to the trainer's batch, and the advantages phase.

* :func:`train_batch`: samples -> :class:`~megatron_rl.training.TrainBatch` (prompt + response ids,
  rollout log-probs, loss mask — aborted samples masked out — group ids, per-token policy versions, MoE
  routes for replay).
* :func:`compute_step_advantages`: the sequence reward on each response's last loss token (per-token
  rewards on their tokens), an optional
  KL-in-reward penalty, the configured estimator (GRPO, RLOO, OTB...), and — when the step's objective
  has the dense KL with its exact sparse part — the future-KL cost-to-go. The imitation warm-up trains
  on the dense KL alone: its reward advantages are zero.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

from megatron_rl.advantages import AdvantageConfig, compute_advantages
from megatron_rl.objectives import ObjectiveConfig, add_future_kl_cost, kl_in_reward
from megatron_rl.orchestration.rollout_phase import Group
from megatron_rl.routing import RoutingLayout, attach_routes
from megatron_rl.training.batch import TrainBatch
from megatron_rl.training.results import ForwardResult


def train_batch(groups: Sequence[Group], routing: Optional[RoutingLayout] = None) -> TrainBatch:
    """The groups' samples as one batch; with ``routing`` (routing replay) the engine's expert choices
    are attached and checked (``megatron_rl.routing.attach_routes``)."""
    samples = [s for g in groups for s in g.samples]
    batch = TrainBatch.from_sequences(
        [s.prompt_ids for s in samples], [s.response_ids for s in samples],
        rollout_logprobs=[s.logprobs for s in samples],
        loss_masks=[[s.finish_reason != "abort"] * len(s.response_ids) for s in samples],
        group_ids=[gi for gi, g in enumerate(groups) for _ in g.samples],
        policy_versions=[s.token_versions() for s in samples])
    return batch if routing is None else attach_routes(batch, samples, routing)


def token_rewards(mask: torch.Tensor, rewards: Sequence[float],
                  per_token: Optional[Sequence[Optional[Sequence[float]]]] = None) -> torch.Tensor:
    """``[B, R]``: each sequence's reward on its last loss token (zero elsewhere) — or, for a sequence with
    per-token (process) rewards, reward j on response token j (zero outside the loss mask)."""
    B, R = mask.shape
    out = torch.zeros(B, R, dtype=torch.float32)
    positions = torch.arange(R).expand(B, R)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=1).values
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] = torch.tensor(rewards, dtype=torch.float32)[rows]
    for i, values in enumerate(per_token or ()):
        if values is not None:
            out[i] = 0.0
            out[i, : len(values)] = torch.tensor(values, dtype=torch.float32)[:R]
    return torch.where(mask, out, torch.zeros(()))


def compute_step_advantages(cfg: AdvantageConfig, objective: ObjectiveConfig, batch: TrainBatch,
                            rewards: Sequence[float], fwd: Optional[ForwardResult], *, imitation_only: bool,
                            ref_logprobs: Optional[torch.Tensor] = None,
                            per_token: Optional[Sequence[Optional[Sequence[float]]]] = None,
                            ) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Per-token advantages ``[B, R]`` for the step, and their metrics. ``per_token``: per sequence, its
    per-token rewards (or None: the sequence reward sits on the last loss token)."""
    mask = batch.response_mask
    if imitation_only:
        adv = torch.zeros(mask.shape, dtype=torch.float32)
    else:
        r = token_rewards(mask, rewards, per_token)
        kl = objective.kl_penalty
        if kl.coef > 0 and kl.placement == "reward":
            exact = fwd.ref_kl if fwd is not None else None
            r = kl_in_reward(r, fwd.logprobs, ref_logprobs, mask, kl, exact)
        adv = compute_advantages(cfg, r, mask, batch.group_ids,
                                 old_logprobs=None if fwd is None else fwd.logprobs,
                                 sum_pi_squared=None if fwd is None else fwd.sum_pi_squared).float()
    if objective.dense_kl.beta > 0 and objective.dense_kl.sparse_includes_future_kl and fwd is not None:
        adv = add_future_kl_cost(adv, fwd.ref_kl, mask, objective.dense_kl).float()
    valid = adv[mask]
    metrics = {"adv/mean": float(valid.mean()) if valid.numel() else 0.0,
               "adv/std": float(valid.std()) if valid.numel() > 1 else 0.0,
               "adv/abs_max": float(valid.abs().max()) if valid.numel() else 0.0}
    return adv, metrics


def forward_metrics(batch: TrainBatch, fwd: ForwardResult, objective: ObjectiveConfig) -> Dict[str, float]:
    """Trainer-vs-rollout agreement of the sampled tokens' log-probs (before any update this step):
    k3 ("mismatch KL") and the largest |Δ log p|, plus entropy and, with a reference, its exact KL
    (``ref_kl_reverse`` = KL(π‖π_ref), or ``ref_kl_forward`` when the step's dense KL is forward)."""
    mask = batch.response_mask
    if not mask.any():
        return {}
    out = {"logprobs/entropy": float(fwd.entropy[mask].mean())}
    if batch.rollout_logprobs is not None:
        # samples come from mu: k3 = rho - 1 - log rho with rho = pi_old / mu estimates KL(mu || pi_old)
        log_ratio = (fwd.logprobs - batch.rollout_logprobs)[mask].double()
        out["logprobs/mismatch_k3"] = float((torch.exp(log_ratio) - 1 - log_ratio).mean())
        out["logprobs/mismatch_max_abs"] = float(log_ratio.abs().max())
    if fwd.ref_kl is not None:
        direction = objective.dense_kl.direction if objective.dense_kl.beta > 0 else "reverse"
        out[f"logprobs/ref_kl_{direction}"] = float(fwd.ref_kl[mask].mean())
    return out
