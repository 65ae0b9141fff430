"""The post-sync check: one fixed pseudo-random probe sequence scored by the trainer and by the engine.

The trainer side (:func:`trainer_probe_logprobs`) is the only place weight transport touches the model's
internals: a forward-only Megatron pass with ``ops.vocab_parallel_stats`` on the last stage (context
parallel: the trainer's zigzag split; MoE: an engine's routing replayed). The engine side is
``WeightReceiver.prompt_logprobs``; :func:`compare_logprobs` judges the two (module doc of ``sync.py``).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_rl.models.router import replay_routing
from megatron_rl.objectives.reduce import zigzag_split
from megatron_rl.ops import vocab_parallel_stats

if TYPE_CHECKING:
    from megatron_rl.weights.sync import WeightSyncConfig


class WeightSyncError(RuntimeError):
    """The sync failed (engine rejected a bucket, a transport error, a failure on another rank)."""


class WeightMismatchError(WeightSyncError):
    """After a sync, the engine's log-probs of the probe differ from the trainer's: garbled weights."""

    def __init__(self, message: str, max_abs_diff: float = math.nan, position: int = -1, replica: int = 0):
        super().__init__(message)
        self.max_abs_diff, self.position, self.replica = max_abs_diff, position, replica


@dataclass
class ProbeCheck:
    """Engine vs trainer log-probs of the probe: the worst replica's largest difference and where it was."""

    max_abs_diff: float
    position: int  # probe position t: the log-prob of token t + 1 given tokens 0..t
    mean_abs_diff: float
    length: int  # probe tokens (length - 1 log-probs compared)
    seconds: float = 0.0


def probe_tokens(vocab_size: int, length: int, seed: int) -> torch.Tensor:
    """``[length]`` int64 pseudo-random token ids in ``[0, vocab_size - 1)``, the same on every rank and every
    run for one seed. (SGLang reports prompt ids ``>= vocab_size - 1`` as 0 in ``input_token_logprobs``, so
    the answer could not be matched to the probe.)"""
    g = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, int(vocab_size) - 1, (int(length),), generator=g)


def probe_length(config: "WeightSyncConfig", built) -> int:
    """The probe length actually used: ``config.probe_length`` capped at the context length - 1 (the
    engine needs room for its one sampled token) and rounded down to a multiple of TP (sequence
    parallelism splits the sequence over TP ranks; context parallelism into ``2·cp`` chunks, each rank's
    pair then over TP)."""
    tp, cp = built.shard.tp.size, built.shard.cp.size
    n = min(config.probe_length, built.arch.max_position_embeddings - 1)
    n -= n % (tp * (2 * cp if cp > 1 else 1))
    if n < 2:
        raise ValueError(f"weight_sync.probe_length={config.probe_length} leaves a probe of {n} tokens for "
                         f"max_position_embeddings={built.arch.max_position_embeddings} and TP={tp}")
    return n


def trainer_probe_logprobs(built, ids: torch.Tensor, routes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[L - 1]`` float32 log-probs of ``ids[1:]`` (teacher-forced, temperature 1) under the Megatron
    model, returned on every rank. Collective: all ranks run the forward (MoE token dispatch crosses DP
    ranks); the last PP stage computes the log-probs from its ``[1, L, V_pad/TP]`` logits with
    ``vocab_parallel_stats`` (padding columns excluded via ``vocab_size``) and broadcasts them over PP.
    ``routes`` (``[L, MoE layers, topk]``, an engine's routing of ``ids``): replayed in the routers. Under
    context parallelism each CP rank feeds its zigzag chunks (as the trainer does) and the last stage
    all-gathers the log-probs over CP."""
    device = next(built.module.parameters()).device
    n = ids.numel()
    tp, cp = built.shard.tp, built.shard.cp
    cols = torch.arange(n) if cp.size == 1 else zigzag_split(torch.arange(n), cp.size, cp.rank)
    ids = ids.reshape(-1)
    tokens, positions = ids[cols].view(1, -1).to(device), cols.view(1, -1).to(device)
    targets = ids[(cols + 1).clamp(max=n - 1)].view(1, -1).to(device)  # the last position's is dropped below
    if routes is not None:
        routes = routes[cols]
    out: Dict[str, torch.Tensor] = {}

    def loss_fn(logits):  # [1, L / CP, V_pad/TP] on the last stage
        stats = vocab_parallel_stats(logits, targets, tp_group=tp.group if tp.size > 1 else None,
                                     vocab_size=built.vocab_size)
        local = stats.logprobs.reshape(-1).float()
        if cp.size > 1:
            parts = [torch.empty_like(local) for _ in range(cp.size)]
            dist.all_gather(parts, local.contiguous(), group=cp.group)
            every = torch.cat([zigzag_split(torch.arange(n), cp.size, r) for r in range(cp.size)]).to(device)
            local = torch.empty(n, dtype=local.dtype, device=device).index_copy_(0, every, torch.cat(parts))
        out["logprobs"] = local[: n - 1]
        return logits.sum() * 0.0, {}

    def step(_data_iterator, model):
        return model(tokens, positions, attention_mask=None), loss_fn

    replay = contextlib.nullcontext()
    if routes is not None:
        layers = [i for i, m in enumerate(built.arch.moe_layers) if m]
        replay = replay_routing(built, {layer: routes[:, k].long() for k, layer in enumerate(layers)})
    was_training = built.module.training
    built.module.eval()  # no dropout; restored below so the trainer's mode is untouched
    try:
        with torch.no_grad(), replay:
            get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]), model=[built.module],
                                        num_microbatches=1, seq_length=n, micro_batch_size=1, forward_only=True)
    finally:
        built.module.train(was_training)
    logprobs = out.get("logprobs")
    if logprobs is None:
        logprobs = torch.empty(n - 1, dtype=torch.float32, device=device)
    pp = built.shard.pp
    if pp.size > 1:
        dist.broadcast(logprobs, src=dist.get_global_rank(pp.group, pp.size - 1), group=pp.group)
    return logprobs.cpu()


def compare_logprobs(trainer: torch.Tensor, engine: torch.Tensor, tolerance: float, ids: torch.Tensor,
                     where: str = "the engine", mean_tolerance: Optional[float] = None) -> ProbeCheck:
    """Raise :class:`WeightMismatchError` if ``max |trainer - engine| > tolerance``, or the mean ``>
    mean_tolerance`` (or anything is not finite); the message names the difference, the worst position
    and its token."""
    if tuple(engine.shape) != tuple(trainer.shape):
        raise WeightMismatchError(f"{where} returned {tuple(engine.shape)} probe log-probs, the trainer "
                                  f"{tuple(trainer.shape)}: it did not score the whole probe sequence")
    diff = (trainer.double() - engine.double()).abs()
    finite = torch.isfinite(diff)
    if not bool(finite.all()):
        raise WeightMismatchError(_nonfinite_message(trainer, engine, where), math.inf, int((~finite).nonzero()[0]))
    pos = int(diff.argmax())
    max_diff, mean_diff = float(diff[pos]), float(diff.mean())
    if not (max_diff <= tolerance and (mean_tolerance is None or mean_diff <= mean_tolerance)):
        limits = f"tolerance {tolerance:g}" + ("" if mean_tolerance is None else f", mean {mean_tolerance:g}")
        raise WeightMismatchError(
            f"weight sync check failed ({where}): the engine's log-probs of the probe sequence differ from the "
            f"trainer's by up to {max_diff:.3g} at probe position {pos} (predicting token id "
            f"{int(ids[pos + 1])}: trainer {float(trainer[pos]):.6g}, engine {float(engine[pos]):.6g}); mean "
            f"|diff| {mean_diff:.3g} over {diff.numel()} positions ({limits}). The engine's weights are not the "
            "trainer's: "
            "a tensor was dropped, permuted, mis-named or mis-cast on the way, or the engine never got these "
            "weights (or the tolerance is too tight for a bf16 engine: raise rollout.weight_sync.check_tolerance / check_mean_tolerance).",
            max_diff, pos)
    return ProbeCheck(max_diff, pos, mean_diff, len(ids))


def _nonfinite_message(trainer: torch.Tensor, engine: torch.Tensor, where: str) -> str:
    """Which side's probe log-probs are non-finite, where first, and what that points to."""
    bad_t, bad_e = ~torch.isfinite(trainer), ~torch.isfinite(engine)
    first = lambda bad: f"{int(bad.sum())} of {bad.numel()}, first at position {int(bad.nonzero()[0])}"  # noqa: E731
    if bool(bad_t.any()):
        side = f"the trainer's probe log-probs are non-finite ({first(bad_t)})"
        if bool(bad_e.any()):
            side += f", and so are the engine's ({first(bad_e)})"
        return (f"weight sync check failed ({where}): {side}: the trainer's weights diverged (an update too large: "
                "lower optim.lr; resume from the last checkpoint)")
    return (f"weight sync check failed ({where}): the engine's probe log-probs are non-finite ({first(bad_e)}) while "
            "the trainer's are finite: the weights overflowed on the way (e.g. a bf16 engine) or the engine's own "
            "numerics failed")
