"""From last-stage sharded logits ``[b, s, V_local]`` and a micro-batch to the RL loss.

Pipeline of one micro-batch (all on the last pipeline stage, identical on every TP rank):

1. next-token targets (``MicroBatch.targets``: position ``t`` predicts the next token of its sequence);
2. :func:`megatron_rl.ops.vocab_parallel_stats` over every position (log-prob, entropy, Σπ², and the
   DVP min-p pruned log-prob when DVP uses min-p; other DVP rules through
   :func:`megatron_rl.objectives.pruned_token_stats`), optionally the exact KL to reference logits;
3. an index gather to response positions ``[n, r]`` (cheap: per-token scalars, never logits), through
   ``MicroBatch.logit_index`` — the same code for padded rows, a packed stream and a context-parallel
   rank's share (whose ``response_mask`` holds only its own tokens); with the fused head (``weight`` given:
   the model returned the output layer's input, see :mod:`megatron_rl.training.head`) the hidden rows are
   gathered first and step 2 runs on them through the ``vocab_parallel_linear_*`` twins, never holding the
   logits;
4. :class:`~megatron_rl.objectives.LossInputs` and :func:`~megatron_rl.objectives.rl_loss` with the
   step's :class:`~megatron_rl.objectives.Normalizer`.

Statistics run over prompt positions too: slicing the logits to the response span would copy them
(``[b, s, V_local]`` is contiguous only as a whole), which costs more memory than the wasted rows cost
time. The fused head instead gathers the hidden rows of the response positions first (``[b, r, H]``,
cheap), so prompt tokens cost it nothing. Nothing here calls ``torch.distributed`` directly; the groups are passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from megatron_rl.objectives import LossInputs, Normalizer, ReduceGroups, pruned_token_stats, rl_loss
from megatron_rl.objectives.records import batch_tokens
from megatron_rl.training.batch import MicroBatch
from megatron_rl.config.train import TrainConfig
from megatron_rl.training.head import Head

Tensor = torch.Tensor


@dataclass
class TokenStats:
    """Per-response-token statistics ``[n, r]`` of the current policy.

    ``logprobs`` is the log-prob the loss uses (DVP-pruned when DVP is on; differentiable);
    ``full_logprobs`` the unpruned one (only with DVP). ``ref_kl`` (differentiable) only with reference
    logits.
    """

    logprobs: Tensor
    entropy: Tensor
    sum_pi_squared: Tensor
    full_logprobs: Optional[Tensor] = None
    kept_mass: Optional[Tensor] = None
    target_kept: Optional[Tensor] = None
    ref_kl: Optional[Tensor] = None

    def detached(self) -> Dict[str, Tensor]:
        return {k: v.detach() for k, v in vars(self).items() if v is not None}


def ref_kl_direction(cfg: TrainConfig) -> str:
    # kl_penalty 'exact' is KL(π_θ‖π_ref); the dense imitation term names its own direction.
    return cfg.objective.dense_kl.direction if cfg.objective.dense_kl.beta > 0 else "reverse"


def token_stats(logits: Tensor, mb: MicroBatch, cfg: TrainConfig, *, tp_group, vocab_size: int,
                ref_logits: Optional[Tensor] = None, weight: Optional[Tensor] = None,
                ref_weight: Optional[Tensor] = None) -> TokenStats:
    """Statistics of ``mb``'s response tokens ``[n, r]`` from this rank's logits shard ``[b, s, V_local]``; with
    ``weight`` (fused head) ``logits``/``ref_logits`` are the output layers' inputs ``[b, s, H]`` and
    ``weight``/``ref_weight`` the policy's/reference's ``[V_local, H]`` output weights."""
    if logits.shape[:2] != mb.input_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match the micro-batch tokens "
                         f"{tuple(mb.input_ids.shape)}")
    targets = mb.targets
    common = dict(tp_group=tp_group, vocab_size=vocab_size, temperature=cfg.temperature, chunk_size=cfg.chunk_size)
    head = Head(logits, weight)
    ref = None if ref_logits is None else Head(ref_logits, ref_weight)
    index = mb.logit_index
    if head.fused:
        # Hidden rows are cheap to gather: compute the statistics at the loss's tokens only, not at every [n, r]
        # slot (a token-budget micro-batch of long-tailed responses is mostly padding slots). Every reader of
        # the statistics masks with ``response_mask``; the other slots hold zeros.
        keep = mb.response_mask if bool(mb.response_mask.any()) else torch.ones_like(mb.response_mask)
        index = index[keep]
        head, targets = head.rows(index), targets.reshape(-1)[index]
        ref = None if ref is None else ref.rows(index)

        def at_response(t: Optional[Tensor]) -> Optional[Tensor]:  # [m] -> [n, r]
            return None if t is None else t.new_zeros(keep.shape).masked_scatter(keep, t)
    else:
        def at_response(t: Optional[Tensor]) -> Optional[Tensor]:  # [b, s] -> [n, r]: padded or packed alike
            return None if t is None else t.reshape(-1)[index]

    st = head.stats(targets, min_p=cfg.dvp_min_p, **common)

    out = TokenStats(at_response(st.logprobs), at_response(st.entropy), at_response(st.sum_pi_squared))
    dvp = cfg.objective.dvp
    if dvp.enabled:
        out.full_logprobs = out.logprobs
        if cfg.dvp_min_p is not None:  # fused in the same pass
            pruned, kept_mass, target_kept = st.pruned_logprobs, st.kept_mass, st.target_kept
        else:
            ps = pruned_token_stats(head.logits(), targets, dvp, **common)
            pruned, kept_mass, target_kept = ps.logprobs, ps.kept_mass, ps.target_kept
        out.logprobs = at_response(pruned)
        out.kept_mass, out.target_kept = at_response(kept_mass), at_response(target_kept)
    if ref is not None:
        kl = head.kl(ref, direction=ref_kl_direction(cfg), **common)
        out.ref_kl = at_response(kl)
    return out


def loss_inputs(stats: TokenStats, mb: MicroBatch) -> LossInputs:
    """The objective's record of one micro-batch (current-policy fields from ``stats``)."""
    if mb.advantages is None:
        raise ValueError("a train step needs TrainBatch.advantages (per-token [B, R])")
    return LossInputs(
        logprobs=stats.logprobs, mask=mb.response_mask, **batch_tokens(mb),
        entropy=stats.entropy, sum_pi_squared=stats.sum_pi_squared, ref_kl=stats.ref_kl,
        kept_mass=stats.kept_mass, target_kept=stats.target_kept,
    )


def normalizer_inputs(mb: MicroBatch, cfg: TrainConfig, current: Optional[Dict[str, Tensor]] = None) -> LossInputs:
    """A record for :func:`~megatron_rl.objectives.step_normalizer` before any gradient pass.

    Without ``current`` (the normaliser does not depend on the current policy, see
    :func:`normalizer_needs_current_policy`), the anchor's log-probs stand in for ``logprobs``: they only
    enter through the finiteness check of the valid mask.
    """
    if mb.advantages is None:
        raise ValueError("a train step needs TrainBatch.advantages (per-token [B, R])")
    if current is not None:
        return LossInputs(logprobs=current["logprobs"], mask=mb.response_mask, **batch_tokens(mb),
                          kept_mass=current.get("kept_mass"), target_kept=current.get("target_kept"))
    stand_in = mb.old_logprobs if mb.old_logprobs is not None else mb.rollout_logprobs
    if stand_in is None:
        stand_in = torch.zeros_like(mb.advantages)
    return LossInputs(logprobs=stand_in, mask=mb.response_mask, **batch_tokens(mb))


def normalizer_needs_current_policy(cfg: TrainConfig) -> bool:
    """True when the step's normaliser counts tokens selected by the *current* policy: a ``kept``
    denominator or IS batch normalisation, with selections that read π_θ (bypass mode's correction and
    TRM statistics, or DVP's ``out_of_set='mask'``)."""
    o = cfg.objective
    counts_selection = o.aggregation.denominator == "kept" or o.correction.is_batch_normalize
    reads_policy = o.policy.mode == "bypass" or (o.dvp.enabled and o.dvp.out_of_set == "mask")
    return counts_selection and reads_policy


def nonfinite_policy_tokens(stats: TokenStats, mask: Tensor) -> Tensor:
    """Loss tokens whose current-policy statistics are not finite: a broken forward pass (the objective
    would silently drop them as data defects), so the step must be skipped."""
    bad = torch.zeros_like(mask)
    for t in (stats.logprobs, stats.entropy, stats.ref_kl):
        if t is not None:
            bad |= ~torch.isfinite(t.detach())
    return (bad & mask).sum()


def micro_batch_loss(logits: Tensor, mb: MicroBatch, cfg: TrainConfig, *, tp_group, vocab_size: int,
                     groups: ReduceGroups, normalizer: Normalizer, ref_logits: Optional[Tensor] = None,
                     weight: Optional[Tensor] = None,
                     ref_weight: Optional[Tensor] = None) -> Tuple[Tensor, Dict[str, Tensor], Tensor]:
    """``(loss contribution, metrics, non-finite policy token count)`` of one micro-batch.

    The contribution follows the objectives' splitting contract: the contributions of all micro-batches
    and data-parallel ranks of the step add up to the loss of the unsplit batch.
    """
    stats = token_stats(logits, mb, cfg, tp_group=tp_group, vocab_size=vocab_size, ref_logits=ref_logits,
                        weight=weight, ref_weight=ref_weight)
    loss, metrics = rl_loss(loss_inputs(stats, mb), cfg.objective, groups, normalizer)
    return loss, metrics, nonfinite_policy_tokens(stats, mb.response_mask)
