"""Float64 single-process references for the vocab-parallel ops (math_spec §1.2, §b.2, §c.3)."""

from __future__ import annotations

from typing import Optional

import torch


def ref_stats(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, temperature: float = 1.0,
              min_p: Optional[float] = None) -> dict:
    """Full-vocabulary float64 statistics of ``logits[..., :vocab_size] / temperature``."""
    z = logits[..., :vocab_size].double() / temperature
    lsm = torch.log_softmax(z, -1)
    p = lsm.exp()
    out = {
        "logprobs": lsm.gather(-1, targets[..., None]).squeeze(-1),
        # clamp: 0 * -inf terms (and their gradients) must vanish for -inf logits
        "entropy": -(p * lsm.clamp(min=-1e300)).sum(-1),
        "sum_pi_squared": (p * p).sum(-1),
    }
    if min_p is not None:
        keep = p >= min_p * p.amax(-1, keepdim=True)
        target_kept = keep.gather(-1, targets[..., None]).squeeze(-1)
        keep_t = keep.clone()
        keep_t.scatter_(-1, targets[..., None], True)
        out["pruned_logprobs"] = torch.log_softmax(z.masked_fill(~keep_t, -torch.inf), -1).gather(
            -1, targets[..., None]).squeeze(-1)
        out["kept_mass"] = (p * keep).sum(-1)
        out["target_kept"] = target_kept
    return out


def ref_kl(logits: torch.Tensor, ref_logits: torch.Tensor, vocab_size: int, direction: str = "reverse",
           temperature: float = 1.0) -> tuple:
    """(KL, TV) in float64 over the real vocabulary."""
    # clamp: zero-probability terms (-inf logits) contribute exactly 0, also to gradients
    a = torch.log_softmax(logits[..., :vocab_size].double() / temperature, -1).clamp(min=-1e300)
    b = torch.log_softmax(ref_logits[..., :vocab_size].double() / temperature, -1).clamp(min=-1e300)
    if direction == "reverse":
        kl = (a.exp() * (a - b)).sum(-1)
    else:
        kl = (b.exp() * (b - a)).sum(-1)
    tv = 0.5 * (a.exp() - b.exp()).abs().sum(-1)
    return kl, tv


def pad_vocab(logits: torch.Tensor, world: int, fill: float = 0.0) -> torch.Tensor:
    """Pad the last dim to a multiple of ``world`` with junk columns (padding must never count)."""
    v = logits.shape[-1]
    padded = -(-v // world) * world
    if padded == v:
        return logits
    junk = torch.full(logits.shape[:-1] + (padded - v,), fill, dtype=logits.dtype)
    return torch.cat([logits, junk], -1)
