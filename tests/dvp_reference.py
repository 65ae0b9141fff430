"""Float64 single-process references for the DVP safe-set rules (sort-based, no thresholds)."""

import math

import torch


def ref_keep(z: torch.Tensor, rule: str, param) -> torch.Tensor:
    """Keep mask ``[rows, V]`` of a rule from scaled, unpadded float64 logits ``[rows, V]``."""
    lsm = torch.log_softmax(z, -1)
    p = lsm.exp()
    if rule == "min_p":
        return p >= param * p.amax(-1, keepdim=True)
    if rule == "abs_logprob":
        return (lsm >= param) | (z == z.amax(-1, keepdim=True))
    if rule == "top_k":
        k = min(param, z.shape[-1])
        kth = z.sort(-1, descending=True).values[:, k - 1:k]
        return z >= kth
    if rule == "top_p":
        ps, order = p.sort(-1, descending=True)
        before = ps.cumsum(-1) - ps  # mass strictly before each sorted token
        n = (before < param).sum(-1, keepdim=True).clamp(min=1)  # smallest prefix with mass >= p
        kth = z.gather(-1, order).gather(-1, n - 1)
        return z >= kth
    raise ValueError(rule)


def ref_pruned(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, rule: str, param,
               temperature: float = 1.0) -> dict:
    """Differentiable (w.r.t. ``logits``) float64 reference of log π_{K∪{y}}(y), Z_K, y ∈ K."""
    z = logits[..., :vocab_size].double() / temperature
    rows = z.reshape(-1, vocab_size)
    t = targets.reshape(-1)
    keep = ref_keep(rows.detach(), rule, param)
    kept = keep.gather(-1, t[:, None]).squeeze(-1)
    keep_f = keep.clone()
    keep_f[torch.arange(len(t)), t] = True
    lp = torch.log_softmax(rows.masked_fill(~keep_f, -math.inf), -1).gather(-1, t[:, None]).squeeze(-1)
    mass = (torch.softmax(rows.detach(), -1) * keep).sum(-1)
    shape = targets.shape
    return {"logprobs": lp.reshape(shape), "kept_mass": mass.reshape(shape), "target_kept": kept.reshape(shape)}
