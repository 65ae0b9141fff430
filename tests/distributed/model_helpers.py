"""Helpers shared by the model tests: HF references (parent process) and Megatron forwards (children)."""

from __future__ import annotations

import os
import warnings
from typing import Dict, List, Optional

import torch

# Known, harmless noise in the child processes (imported before megatron there): missing TE/Apex,
# deprecated torch collective names, CUDA-only performance hints.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")

SEQ, BATCH = 12, 2


def make_inputs(vocab: int, seed: int = 0, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(path: str, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(path)(ids).logits.float()


def hf_tensors(path: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: Dict[str, torch.Tensor] = {}
    for fn in sorted(os.listdir(path)):
        if fn.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, fn)))
    return out


def export_mismatches(built, reference: Dict[str, torch.Tensor]) -> List[str]:
    """Names whose exported tensor is not bitwise the reference (plus missing / extra names)."""
    from megatron_rl.models.weights import export_hf_state_dict

    exported = export_hf_state_dict(built)
    bad = sorted(set(exported) ^ set(reference))
    bad += [n for n in reference if n in exported and not torch.equal(exported[n], reference[n])]
    return bad


def export_grads(built) -> Dict[str, torch.Tensor]:
    """The parameters' gradients under their HF names (the export path applied to ``.grad``)."""
    from megatron_rl.models.weights import export_hf_state_dict

    params = list(built.module.parameters())
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.grad if p.grad is not None else torch.zeros_like(p)
        return export_hf_state_dict(built)
    finally:
        for p, data in zip(params, saved):
            p.data = data


def forward_logits(built, ids: torch.Tensor, num_microbatches: int = 1) -> Optional[torch.Tensor]:
    """Full-vocabulary logits ``[b, s, V]`` through Megatron's pipeline schedule (forward only).

    Returns the logits on the last pipeline stage (gathered over TP), None elsewhere.
    """
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    b, s = ids.shape
    mbs = b // num_microbatches
    pos = torch.arange(s).expand(mbs, -1)
    batches = iter(ids.split(mbs))

    def step(data_iterator, model):
        out = model(next(data_iterator), pos, attention_mask=None)
        return out, lambda o: (o.sum() * 0.0, {"logits": o.detach()})

    built.module.eval()
    with torch.no_grad():
        store = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=batches,
            model=[built.module],
            num_microbatches=num_microbatches,
            seq_length=s,
            micro_batch_size=mbs,
            forward_only=True,
        )
    if not built.post_process:
        return None
    local = torch.cat([d["logits"] for d in store])  # [b, s, V_pad/TP]
    tp = built.shard.tp
    if tp.size > 1:
        parts = [torch.empty_like(local) for _ in range(tp.size)]
        dist.all_gather(parts, local.contiguous(), group=tp.group)
        local = torch.cat(parts, dim=-1)
    assert local.shape[-1] == built.padded_vocab_size
    pad = local[..., built.vocab_size :]
    assert torch.all(pad == 0), "padded vocabulary rows must give zero logits"
    return local[..., : built.vocab_size]
