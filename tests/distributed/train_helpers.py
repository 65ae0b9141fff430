"""Helpers of the trainer tests: synthetic RL batches, one trainer run per layout, gradient export.

Everything here runs inside the spawned ranks (module-level functions, picklable arguments).
"""

from __future__ import annotations

import warnings
from typing import Dict, Optional

import torch

warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")

VOCAB = 250


def make_batch(batch_size: int = 8, seed: int = 0, vocab: int = VOCAB, max_prompt: int = 6, max_response: int = 9,
               moe_layers: int = 0, topk: int = 2, num_experts: int = 4):
    """A synthetic RL batch: variable prompt/response lengths, a few tool tokens masked out, per-token
    advantages and rollout/old/ref log-probs near each other (so clipping and IS weights are active)."""
    from megatron_rl.training import TrainBatch

    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(2, max_prompt + 1, (batch_size,), generator=g)
    rlen = torch.randint(1, max_response + 1, (batch_size,), generator=g)
    prompts = [torch.randint(0, vocab, (int(n),), generator=g) for n in plen]
    responses = [torch.randint(0, vocab, (int(n),), generator=g) for n in rlen]
    masks = [torch.rand(int(n), generator=g) > 0.15 for n in rlen]  # some tool/observation tokens
    routed = None
    if moe_layers:
        routed = [torch.stack([torch.randperm(num_experts, generator=g)[:topk]
                               for _ in range(int(p + r) * moe_layers)]).reshape(int(p + r), moe_layers, topk)
                  for p, r in zip(plen, rlen)]
    batch = TrainBatch.from_sequences(prompts, responses, loss_masks=masks, routed_experts=routed,
                                      group_ids=torch.arange(batch_size) // 2)
    B, R = batch.response_mask.shape
    rollout = -torch.rand(B, R, generator=g) * 4 - 1.0
    return batch.replace(
        advantages=torch.randn(B, R, generator=g),
        rollout_logprobs=rollout,
        old_logprobs=rollout + 0.1 * torch.randn(B, R, generator=g),
        ref_logprobs=rollout + 0.2 * torch.randn(B, R, generator=g),
    )


def export_main_grads(trainer) -> Dict[str, torch.Tensor]:
    """Full gradients under HF names (collective): the DDP ``main_grad`` buffers (or ``.grad``) swapped
    into the parameters for the export path. Needs the non-distributed optimizer (complete grads)."""
    from megatron_rl.models.weights import export_hf_state_dict

    params = list(trainer.module.parameters())
    saved = [p.data for p in params]
    try:
        for p in params:
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            p.data = torch.zeros_like(p) if g is None else g.detach().view_as(p)
        return {k: v.clone() for k, v in export_hf_state_dict(trainer.built).items()}
    finally:
        for p, data in zip(params, saved):
            p.data = data


def plain_autograd_reference(path: str, batch, train_cfg, groups) -> Dict:
    """Loss and gradients of the unsplit batch: one forward of the whole batch through a plain GPTModel
    (no schedule, no DDP), the objective on all tokens at once, ``loss.backward()``. Also the
    response-aligned current-policy statistics ``[B, R]`` (for forward-pass checks)."""
    import contextlib

    from megatron_rl.models.build import build_model
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.models.router import replay_routing, tokens_from_batch_major
    from megatron_rl.objectives import ReduceGroups, rl_loss
    from megatron_rl.training import loss_glue, make_micro_batches

    assert groups.layout.tp == 1 and groups.layout.pp == 1
    ref_logits = None
    (mb,) = make_micro_batches(batch, batch.batch_size, group_by_length=False)
    if train_cfg.reference_model is not None:
        ref_built = build_model(train_cfg.reference_model, groups)
        with torch.no_grad():
            ref_logits = ref_built.module(mb.input_ids, mb.position_ids, attention_mask=None)
    built = build_model(ModelConfig(hf_path=path), groups)
    routing = contextlib.nullcontext()
    if train_cfg.routing_replay:
        moe = [i for i, m in enumerate(built.arch.moe_layers) if m]
        routing = replay_routing(built, {layer: tokens_from_batch_major(mb.routed_experts[:, :, i])
                                         for i, layer in enumerate(moe)})
    with routing:
        logits = built.module(mb.input_ids, mb.position_ids, attention_mask=None)
    stats = loss_glue.token_stats(logits, mb, train_cfg, tp_group=None, vocab_size=built.vocab_size,
                                  ref_logits=ref_logits)
    loss, _ = rl_loss(loss_glue.loss_inputs(stats, mb), train_cfg.objective, ReduceGroups())
    loss.backward()
    from model_helpers import export_grads

    grads = export_grads(built)
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
    return {"loss": loss.item(), "grad_norm": norm, "grads": grads, "stats": stats.detached()}


def train_run(path: str, layout: dict, batch, train_cfg, optim_cfg, steps: int = 2, grads: bool = True,
              model_overrides: Optional[dict] = None, forward: bool = False) -> Dict:
    """Build a trainer for ``layout``, train ``steps`` steps on this rank's share of ``batch``; return the
    per-step losses and grad norms, the first step's full gradients (HF names), and with ``forward``
    the forward-only statistics of the initial weights."""
    from megatron_rl import parallel
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.training import PolicyTrainer

    groups = parallel.init_megatron_parallel(parallel.ParallelLayout(**layout))
    trainer = PolicyTrainer(ModelConfig(hf_path=path, **(model_overrides or {})), train_cfg, groups, optim_cfg)
    dp = torch.distributed.get_world_size(groups.dp)
    local = batch.split(dp)[groups.dp_rank]
    out = {"losses": [], "grad_norms": [], "grads": None, "skipped": []}
    if forward:
        out["forward"] = vars(trainer.forward(local))
    for i in range(steps):
        r = trainer.train_step(local)
        out["losses"].append(r.loss)
        out["grad_norms"].append(r.grad_norm)
        out["skipped"].append(r.skipped)
        if i == 0:
            out["metrics"] = r.metrics
            if grads:
                out["grads"] = export_main_grads(trainer)
    return out
