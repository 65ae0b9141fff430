"""Capture the expert ids chosen by each sparse-MoE router of a ``transformers`` model.

A forward hook on every sparse-MoE block's router (``block.gate``; transformers 5 Qwen2/Qwen3-MoE
``*TopKRouter`` returning ``(logits, scores, indices)``; older releases return the logits of an
``nn.Linear`` gate, for which we take the top-k of its softmax). Each forward pass yields one
``[tokens, topk]`` tensor per MoE layer, layers in module order, tokens in the flattened ``[batch, seq]``
order the block sees.

Note for replay: ``generate``-style decoding never feeds the last sampled token back, so its routing
is never computed (cpu_notes.md); the embedded engine fills it with one extra decode step.
"""

from __future__ import annotations

import re
from typing import List, Optional, Tuple

import torch

from megatron_rl.rollout.client.protocol import ExpertLayout

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _find_moe_routers(model: torch.nn.Module) -> List[Tuple[int, torch.nn.Module]]:
    """``(decoder layer index, router)`` of every sparse-MoE block, in module order."""
    routers = []
    for name, module in model.named_modules():
        gate = getattr(module, "gate", None)
        if gate is not None and hasattr(module, "experts") and isinstance(gate, torch.nn.Module):
            m = _LAYER.search(name + ".")
            routers.append((int(m.group(1)) if m else len(routers), gate))
    return routers


def _top_k_of(router: torch.nn.Module, model_config) -> int:
    for owner in (router, model_config):
        for attr in ("top_k", "num_experts_per_tok"):
            value = getattr(owner, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    raise ValueError(f"cannot tell how many experts {type(router).__name__} picks per token (no top_k)")


class RoutingRecorder:
    """``recorder.enabled = True``; run forwards; ``recorder.pop()`` -> ``[L] x [tokens, topk]`` int32 for
    the forward(s) since the last pop (concatenated along tokens if several)."""

    def __init__(self, model: torch.nn.Module):
        found = _find_moe_routers(model)
        self.layer_indices = [i for i, _ in found]  # decoder layer of each router
        self.routers = [r for _, r in found]
        config = getattr(model, "config", None)
        self.num_hidden_layers = int(getattr(config, "num_hidden_layers", 0) or 0) or (
            max(self.layer_indices, default=-1) + 1)
        self.top_k = _top_k_of(self.routers[0], config) if self.routers else 0
        self.enabled = False
        self._records: List[List[torch.Tensor]] = [[] for _ in self.routers]
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    @property
    def is_moe(self) -> bool:
        return bool(self.routers)

    @property
    def layout(self) -> Optional[ExpertLayout]:
        """Which decoder layers hold the routers (SGLang's routed-experts rows), None for a dense model."""
        if not self.routers:
            return None
        moe = set(self.layer_indices)
        return ExpertLayout(tuple(i in moe for i in range(self.num_hidden_layers)), self.top_k)

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            if not self.enabled:
                return
            if isinstance(output, tuple) and len(output) >= 3:
                ids = output[2]
            else:  # an nn.Linear router returning logits
                logits = output[0] if isinstance(output, tuple) else output
                ids = torch.topk(torch.softmax(logits.float(), dim=-1), self.top_k, dim=-1).indices
            self._records[layer].append(ids.detach().reshape(-1, ids.shape[-1]).to(torch.int32))

        return hook

    def pop(self) -> Optional[List[torch.Tensor]]:
        if not self.routers or not self._records[0]:
            return None
        # one device -> host copy per forward for all layers (rows keep them until their answer)
        sizes = [sum(len(t) for t in r) for r in self._records]
        out = list(torch.cat([t for r in self._records for t in r], dim=0).cpu().split(sizes))
        self._records = [[] for _ in self.routers]
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
