"""Per-token returns, whitening and compression helpers for advantage estimators (controller side).

All tensors are full (unsharded) padded ``[B, T]``; ``mask`` marks model-generated tokens. Rewards are
per token (an outcome reward sits on the last valid token). Masked positions (padding, tool tokens)
neither add reward nor count as a discount step.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _zero(x: Tensor) -> Tensor:
    return torch.zeros((), dtype=x.dtype, device=x.device)


def masked_where(mask: Tensor, x: Tensor) -> Tensor:
    return torch.where(mask, x, _zero(x))


def sequence_scores(token_rewards: Tensor, mask: Tensor) -> Tensor:
    """R_i = Σ_t m_t r_t ``[B]``."""
    return masked_where(mask, token_rewards).sum(-1)


def return_to_go(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """G_t = Σ_{t' >= t, valid} γ^{#valid steps from t to t'} r_{t'} on valid tokens, 0 elsewhere."""
    mask = mask.bool()
    r = masked_where(mask, token_rewards)
    if gamma == 1.0:
        return masked_where(mask, r.flip(-1).cumsum(-1).flip(-1))
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        running = torch.where(mask[:, t], r[:, t] + gamma * running, running)
        out[:, t] = torch.where(mask[:, t], running, _zero(r))
    return out


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x − mean) / sqrt(var + eps) over valid tokens, unbiased variance (verl ``masked_whiten``)."""
    mask = mask.bool()
    n = mask.sum().clamp(min=1)
    mean = masked_where(mask, x).sum() / n
    var = masked_where(mask, (x - mean).square()).sum() / (n - 1).clamp(min=1)
    return masked_where(mask, (x - mean) * torch.rsqrt(var + eps))


def compress(x: Tensor, mask: Tensor) -> Tensor:
    """Left-align each row's valid tokens: ``[B, T] -> [B, T]`` with valid token k of row b at [b, k]."""
    idx = (mask.long().cumsum(-1) - 1).clamp(min=0)
    out = torch.zeros_like(x)
    rows = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(idx)
    out[rows[mask], idx[mask]] = x[mask]
    return out


def expand(xc: Tensor, mask: Tensor) -> Tensor:
    """Inverse of :func:`compress` on valid positions (zero elsewhere)."""
    idx = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return masked_where(mask, xc.gather(-1, idx))
