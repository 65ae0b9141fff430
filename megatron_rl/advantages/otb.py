"""Optimal Token Baseline with the logit-gradient proxy (arXiv 2602.07078; math_spec §d, verl semantics).

Per prompt group and position t:

    w_j  = 1 − 2 π_j + Σ_v π_j(v)²         (= ‖∇_z log π(y_j)‖², in [0, 2]; π_j from the old policy)
    W_t  = Σ_{j <= t} m_j w_j               (realised energy, prefix over valid tokens)
    B*_t = Σ_i G_t W_t m_t / (Σ_i W_t m_t + ε)
    A_t  = (G_t − B*_t) m_t

W is only the averaging weight of the baseline (no extra 1/W factor, as in verl). Pass the loss mask
*after* any rejection (RS/TRM) so rejected tokens neither receive nor donate baseline mass (§d.4).
Runs on the controller over full ``[B, T]`` tensors: W is a prefix sum and B* couples a whole group.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rl.advantages.outcome import group_index
from megatron_rl.advantages.returns import compress, expand, masked_where, return_to_go

Tensor = torch.Tensor


def logit_gradient_proxy(logprobs: Tensor, sum_pi_squared: Tensor, mask: Tensor) -> Tensor:
    """w = 1 − 2π_y + Σπ² per valid token (tiny negatives from rounding clamped to 0)."""
    w = (1 - 2 * torch.exp(logprobs) + sum_pi_squared).clamp(min=0)
    return masked_where(mask.bool(), w)


def position_baseline(G: Tensor, W: Tensor, mask: Tensor, group_ids, eps: float = 1e-8,
                      handle_zero_tail: bool = True) -> Tensor:
    """B*_t per (group, position) broadcast back to ``[B, T]``; 0 for groups with one non-empty member
    (empty members — no valid token — do not count: a response whose only group-mate is empty gets A = G).

    ``handle_zero_tail``: when exactly one member of a group is the longest (strictly longer than the
    second-longest), its positions beyond the second-longest length get B* = 0 — otherwise the
    baseline there is its own return and the advantage is identically 0.
    """
    mask = mask.bool()
    g = group_index(group_ids).to(G.device)
    n_groups = int(g.max()) + 1 if g.numel() else 0
    T = G.shape[1]
    num = torch.zeros(n_groups, T, dtype=G.dtype, device=G.device).index_add_(0, g, masked_where(mask, G * W))
    den = torch.zeros_like(num).index_add_(0, g, masked_where(mask, W))
    base = (num / (den + eps))[g]
    nonempty = mask.any(-1).to(G.dtype)
    size = torch.zeros(n_groups, dtype=G.dtype, device=G.device).index_add_(0, g, nonempty)[g]
    base = torch.where(size[:, None] > 1, base, torch.zeros_like(base))
    if handle_zero_tail:
        pos = torch.arange(T, device=G.device)
        length = torch.where(mask, pos + 1, torch.zeros_like(pos)).amax(-1)  # last valid position + 1
        for grp in range(n_groups):
            members = (g == grp).nonzero().squeeze(-1)
            if members.numel() < 2:
                continue
            lens, order = length[members].sort(descending=True)
            if lens[0] > lens[1]:
                base[members[order[0]], int(lens[1]):] = 0
    return base


def otb(token_rewards: Tensor, mask: Tensor, group_ids, old_logprobs: Tensor, sum_pi_squared: Tensor,
        is_weights: Optional[Tensor] = None, handle_zero_tail: bool = True, align: str = "position",
        eps: float = 1e-8) -> Tensor:
    """OTB advantages ``[B, T]``.

    ``is_weights``: optional (truncated, detached) rollout IS weights; w ← w·ρ̄² (off-policy variant).
    ``align``: ``position`` (baseline per response position, single-turn) or ``valid_token`` (responses
    compressed to their model-generated tokens and aligned by valid-token index, the multi-turn /
    tool-integrated variant).
    """
    if align not in ("position", "valid_token"):
        raise ValueError(f"otb: align={align!r} must be 'position' or 'valid_token'")
    mask = mask.bool()
    G = return_to_go(token_rewards, mask)
    w = logit_gradient_proxy(old_logprobs, sum_pi_squared, mask)
    if is_weights is not None:
        w = w * masked_where(mask, is_weights).square()
    W = masked_where(mask, w.cumsum(-1))
    if align == "valid_token":
        mc = compress(mask, mask)
        base = position_baseline(compress(G, mask), compress(W, mask), mc, group_ids, eps, handle_zero_tail)
        base = expand(base, mask)
    else:
        base = position_baseline(G, W, mask, group_ids, eps, handle_zero_tail)
    return masked_where(mask, G - base)
