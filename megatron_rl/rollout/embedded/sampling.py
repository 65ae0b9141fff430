"""Token sampling with SGLang's semantics and exact log-probs, batch-composition independent.

Pure tensor math, no model: the embedded engine calls ``sample_next`` once per decode step. Every row
draws its uniform from its own ``torch.Generator`` and is sampled by inverse CDF over its own
distribution -- in descending-probability order when a filter (top-k / top-p / min-p) or greedy needs the
sort, in token-id order when the row is unfiltered (no ``[B, V]`` sort) -- so a row's token depends only on
its logits, its parameters and its generator -- never on which other requests share the batch. (Up to float non-associativity in the batched forward pass
that produced the logits: a batch-size-dependent rounding of ~1e-7 could flip a draw that lands that
close to a CDF boundary.)

Conventions (``raw`` / ``processed`` log-probs, filter order) are documented in ``protocol.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from megatron_rl.rollout.client.protocol import LOGPROB_MODES, SamplingParams


def make_generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


@dataclass
class RowParams:
    """Per-row sampling parameters as ``[B]`` tensors (built once per batch)."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, <= 0 = disabled
    top_p: torch.Tensor  # [B] float64
    min_p: torch.Tensor  # [B] float32

    @staticmethod
    def from_params(params: Sequence[SamplingParams], device: Optional[torch.device] = None) -> "RowParams":
        """On ``device``: the logits' (the engine builds them once per batch composition, not per step)."""
        return RowParams(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            # past 2**30 (SGLang's "whole vocabulary") a top_k means the same and must fit int64
            top_k=torch.tensor([min(p.top_k, 1 << 30) for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
        )


@dataclass
class StepResult:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32, convention per logprob_mode
    top_ids: Optional[torch.Tensor]  # [B, n] int64, or None
    top_values: Optional[torch.Tensor]  # [B, n] float32, or None
    processed: Optional[torch.Tensor] = None  # [B] float32 "processed" log-probs, whatever logprob_mode is
    support: Optional[torch.Tensor] = None  # [B] int64: tokens in the kept set (SGLang's sampling support)


def kept_mask_sorted(sorted_logp: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """``[B, V]`` bool: which of the descending-sorted tokens survive top-k, top-p and min-p ("joint":
    every filter is computed on the unfiltered temperature-scaled distribution, as SGLang's torch
    sampler does). Greedy rows keep only the argmax. Always keeps column 0 (the argmax)."""
    B, V = sorted_logp.shape
    rank = torch.arange(V, device=sorted_logp.device).unsqueeze(0)
    top_k = torch.where(rows.top_k > 0, rows.top_k, torch.full_like(rows.top_k, V))
    top_k = torch.where(rows.temperature == 0, torch.ones_like(top_k), top_k)
    keep = rank < top_k.unsqueeze(1)
    # top-p only where < 1: at 1.0 a float cumsum that rounds above 1 would wrongly cut the tail.
    probs64 = sorted_logp.double().exp()
    mass_before = torch.cumsum(probs64, dim=-1) - probs64
    use_p = (rows.top_p < 1.0).unsqueeze(1)
    keep &= ~use_p | (mass_before <= rows.top_p.unsqueeze(1))
    # min-p in log space: p >= min_p * p_max  <=>  logp >= logp_max + log(min_p) (min_p = 0 keeps all).
    log_min_p = torch.log(rows.min_p).unsqueeze(1)  # -inf where min_p == 0
    keep &= sorted_logp >= sorted_logp[:, :1] + log_min_p
    keep[:, 0] = True
    return keep


def sample_next(
    logits: torch.Tensor,
    rows: RowParams,
    generators: Sequence[torch.Generator],
    logprob_mode: str = "raw",
    top_n: int = 0,
) -> StepResult:
    """Sample one token per row of ``logits [B, V]`` (any float dtype; computed in fp32).

    Returns the sampled ids and their log-probs under ``logprob_mode``; with ``top_n > 0`` also the
    ``top_n`` most likely ids and their log-probs under the same convention (``-inf`` for tokens
    outside the kept set in ``processed`` mode).
    """
    if logprob_mode not in LOGPROB_MODES:
        raise ValueError(f"logprob_mode={logprob_mode!r}: expected one of {LOGPROB_MODES}")
    assert logits.dim() == 2 and logits.shape[0] == len(generators), (tuple(logits.shape), len(generators))
    temps = torch.where(rows.temperature == 0, torch.ones_like(rows.temperature), rows.temperature)
    scaled = logits.float() / temps.unsqueeze(1)
    logp = torch.log_softmax(scaled, dim=-1)  # [B, V] the "raw" convention
    plain = unfiltered_rows(rows)
    if bool(plain.all()):
        return _sample_plain(logp, generators, top_n)
    if bool(plain.any()):  # a mixed batch: each row takes the path its own parameters choose
        B, dev = len(generators), logits.device
        out = StepResult(tokens=torch.empty(B, dtype=torch.int64, device=dev),
                         logprobs=torch.empty(B, dtype=torch.float32, device=dev), top_ids=None, top_values=None,
                         processed=torch.empty(B, dtype=torch.float32, device=dev),
                         support=torch.empty(B, dtype=torch.int64, device=dev))
        idx = {True: plain.nonzero().squeeze(1), False: (~plain).nonzero().squeeze(1)}
        parts = {True: _sample_plain(logp[idx[True]], [generators[i] for i in idx[True].tolist()], top_n),
                 False: _sample_sorted(logp[idx[False]], _take_rows(rows, idx[False]),
                                       [generators[i] for i in idx[False].tolist()], logprob_mode, top_n)}
        if top_n > 0:
            n = min(top_n, logits.shape[1])
            out.top_ids = torch.empty(B, n, dtype=torch.int64, device=dev)
            out.top_values = torch.empty(B, n, dtype=torch.float32, device=dev)
        for key, part in parts.items():
            out.tokens[idx[key]] = part.tokens
            out.logprobs[idx[key]] = part.logprobs
            out.processed[idx[key]] = part.processed
            out.support[idx[key]] = part.support
            if top_n > 0:
                out.top_ids[idx[key]] = part.top_ids
                out.top_values[idx[key]] = part.top_values
        return out
    return _sample_sorted(logp, rows, generators, logprob_mode, top_n)


def unfiltered_rows(rows: RowParams) -> torch.Tensor:
    """``[B]`` bool: rows sampled from the full temperature-scaled distribution (no top-k / top-p / min-p,
    not greedy). Their kept set is the whole vocabulary, so "raw" and "processed" log-probs coincide and
    no sort is needed (:func:`_sample_plain`)."""
    return (rows.temperature > 0) & (rows.top_k <= 0) & (rows.top_p >= 1.0) & (rows.min_p <= 0.0)


def _take_rows(rows: RowParams, idx: torch.Tensor) -> RowParams:
    return RowParams(temperature=rows.temperature[idx], top_k=rows.top_k[idx], top_p=rows.top_p[idx],
                     min_p=rows.min_p[idx])


def _uniforms(generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One uniform per row from its own seeded host generator (the same stream on CPU and GPU, so a seed
    gives the same tokens on either); the callers move them to the logits' device in one copy per step."""
    return torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])


def _sample_plain(logp: torch.Tensor, generators: Sequence[torch.Generator], top_n: int) -> StepResult:
    """Unfiltered rows: inverse CDF over the distribution in token-id order (one uniform per row, from the
    row's own generator, as on the sorted path), without the ``[B, V]`` sort the filters need -- on CPU
    that sort was most of a small model's decode step. The draw is exact for the same distribution; only
    which token a given uniform maps to differs from the sorted order, still a pure function of the row."""
    u = _uniforms(generators).to(logp.device, non_blocking=True)
    # exp in fp32 (vectorised; fp64 exp is ~10x slower on CPU), accumulated in fp64
    probs = logp.exp().double()
    cdf = torch.cumsum(probs, dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)  # never a zero-probability token...
    over = tokens >= logp.shape[1]
    if bool(over.any()):  # ...except past the end, when u * total rounds up to it: take the last possible one
        last = logp.shape[1] - 1 - torch.argmax((probs[over] > 0).flip(-1).to(torch.uint8), dim=-1)
        tokens[over] = last
    logprobs = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_ids = top_values = None
    if top_n > 0:
        n = min(top_n, logp.shape[1])
        sorted_logp, order = torch.sort(logp, dim=-1, descending=True, stable=True)
        top_ids, top_values = order[:, :n].clone(), sorted_logp[:, :n].clone()
    support = (probs > 0).sum(-1)
    return StepResult(tokens=tokens, logprobs=logprobs, top_ids=top_ids, top_values=top_values, processed=logprobs,
                      support=support)


def _sample_sorted(logp: torch.Tensor, rows: RowParams, generators: Sequence[torch.Generator], logprob_mode: str,
                   top_n: int) -> StepResult:
    """Rows with a filter (or greedy): inverse CDF over the kept prefix of the descending-sorted distribution."""
    # stable=True: among equal probabilities the lower token id comes first, like torch.argmax.
    sorted_logp, order = torch.sort(logp, dim=-1, descending=True, stable=True)
    keep = kept_mask_sorted(sorted_logp, rows)

    # Inverse CDF over the kept prefix, one uniform per row from that row's own generator.
    u = _uniforms(generators).to(logp.device, non_blocking=True)
    cdf = torch.cumsum(sorted_logp.double().exp() * keep, dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    pos = torch.searchsorted(cdf, target, right=True).squeeze(1)
    pos = torch.minimum(pos, keep.sum(-1) - 1)  # u*total can round up to the last cdf value
    tokens = order.gather(1, pos.unsqueeze(1)).squeeze(1)

    masked = sorted_logp.masked_fill(~keep, float("-inf"))
    sorted_processed = masked - torch.logsumexp(masked, dim=-1, keepdim=True)
    processed = sorted_processed.gather(1, pos.unsqueeze(1)).squeeze(1)
    sorted_out = sorted_logp if logprob_mode == "raw" else sorted_processed
    logprobs = sorted_out.gather(1, pos.unsqueeze(1)).squeeze(1)
    top_ids = top_values = None
    if top_n > 0:
        n = min(top_n, logp.shape[1])
        top_ids, top_values = order[:, :n].clone(), sorted_out[:, :n].clone()
    return StepResult(tokens=tokens, logprobs=logprobs, top_ids=top_ids, top_values=top_values, processed=processed,
                      support=_support(sorted_logp, keep, rows))


def _support(sorted_logp: torch.Tensor, keep: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """``[B]`` SGLang's sampling support: its top-k is a threshold (``p >= p_k``), so tokens tied with the k-th
    are in the support too (the usual cause of a --sampling-mask-max-tokens overflow); sampling here still keeps
    exactly the top-k prefix. Greedy / top_k=1 rows: the argmax alone."""
    kept = keep.sum(-1)
    edge = sorted_logp.gather(1, (kept - 1).unsqueeze(1))
    tied = (sorted_logp >= edge).sum(-1)
    return torch.where((rows.top_k > 1) & (rows.temperature > 0), torch.maximum(kept, tied), kept)


def processed_logprob_reference(logits: torch.Tensor, token: int, params: SamplingParams) -> float:
    """Slow one-row float64 reference of the ``processed`` log-prob (tests use it as an oracle)."""
    t = 1.0 if params.temperature == 0 else params.temperature
    p = torch.softmax(logits.double() / t, dim=-1)
    vals, idx = torch.sort(p, descending=True, stable=True)
    kept: List[int] = []
    mass = 0.0
    k = 1 if params.temperature == 0 else (params.top_k if params.top_k > 0 else len(vals))
    for r in range(len(vals)):
        ok = r < k and (params.top_p >= 1.0 or mass <= params.top_p) and vals[r] >= params.min_p * vals[0]
        if ok or r == 0:
            kept.append(int(idx[r]))
        mass += float(vals[r])
    if token not in kept:
        return float("-inf")
    return float(torch.log(p[token] / p[kept].sum()))
