"""Group-relative outcome advantages: GRPO (± std normalisation; Dr.GRPO), RLOO, REINFORCE++ (± baseline).

Inputs are full ``[B, T]`` per-token rewards and mask plus ``group_ids`` ``[B]`` (the prompt id, verl
``uid``). Outputs are per-token ``[B, T]`` (the sequence value on every valid token, 0 elsewhere).
Groups of size 1 follow verl: mean 0 and std 1 (GRPO), advantage = score (RLOO).
"""

from __future__ import annotations

import torch

from megatron_rl.advantages.returns import masked_where, masked_whiten, return_to_go, sequence_scores

Tensor = torch.Tensor


def group_index(group_ids) -> Tensor:
    """Dense group index ``[B]`` in 0..G-1 from any integer ids (tensor or list)."""
    ids = torch.as_tensor(group_ids)
    return torch.unique(ids, return_inverse=True)[1]


def group_stats(scores: Tensor, group_ids):
    """Per-sequence group size, mean and unbiased std ``[B]`` of ``scores`` ``[B]``."""
    g = group_index(group_ids).to(scores.device)
    n_groups = int(g.max()) + 1 if g.numel() else 0
    n = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, g, torch.ones_like(scores))
    s = torch.zeros_like(n).index_add_(0, g, scores)
    mean = s / n
    sq = torch.zeros_like(n).index_add_(0, g, (scores - mean[g]).square())
    std = torch.sqrt(sq / (n - 1).clamp(min=1))
    return n[g], mean[g], std[g]


def grpo(token_rewards: Tensor, mask: Tensor, group_ids, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """A_i = (R_i − mean_g) / (std_g + eps) (GRPO) or R_i − mean_g (``norm_by_std=False``, Dr.GRPO)."""
    mask = mask.bool()
    scores = sequence_scores(token_rewards, mask)
    n, mean, std = group_stats(scores, group_ids)
    single = n <= 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    adv = (scores - mean) / (std + eps) if norm_by_std else scores - mean
    return masked_where(mask, adv[:, None].expand_as(token_rewards))


def rloo(token_rewards: Tensor, mask: Tensor, group_ids) -> Tensor:
    """Leave-one-out baseline: A_i = R_i − mean_{j≠i} R_j = N/(N−1) (R_i − mean_g)."""
    mask = mask.bool()
    scores = sequence_scores(token_rewards, mask)
    n, mean, _ = group_stats(scores, group_ids)
    adv = torch.where(n > 1, (scores - mean) * n / (n - 1).clamp(min=1), scores)
    return masked_where(mask, adv[:, None].expand_as(token_rewards))


def reinforce_pp(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """REINFORCE++: discounted return-to-go per token, whitened over the batch's valid tokens."""
    mask = mask.bool()
    return masked_whiten(return_to_go(token_rewards, mask, gamma), mask)


def reinforce_pp_baseline(token_rewards: Tensor, mask: Tensor, group_ids) -> Tensor:
    """REINFORCE++-baseline: score minus its group mean, broadcast to tokens, whitened over the batch."""
    mask = mask.bool()
    scores = sequence_scores(token_rewards, mask)
    n, mean, _ = group_stats(scores, group_ids)
    adv = scores - torch.where(n > 1, mean, torch.zeros_like(mean))
    return masked_whiten(masked_where(mask, adv[:, None].expand_as(token_rewards)), mask)
