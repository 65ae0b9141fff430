"""Copy HF-checkpoint-named tensors into a live ``transformers`` model (the weight-update target).

The trainer's Megatron -> HF mapping emits checkpoint names (``model.layers.3.mlp.experts.7.up_proj.weight``),
but transformers 5 keeps MoE experts fused in memory (``mlp.experts.gate_up_proj [E, 2I, H]`` with gate
rows first, ``mlp.experts.down_proj [E, H, I]``). ``HFWeightTarget`` resolves both spellings: a
state-dict name is copied whole; a per-expert checkpoint name is copied into its slice of the fused
tensor, so experts may arrive one at a time in any bucket.

A bucket is validated whole (every name known, every shape right) before anything is copied, so a bad
bucket changes nothing; the error lists every unknown name with the closest known one.
"""

from __future__ import annotations

import difflib
import re
from typing import Dict, Iterable, List, Optional, Tuple

import torch

_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class WeightUpdateError(ValueError):
    """A bucket named a tensor the model does not have, or gave the wrong shape; nothing was copied."""


class HFWeightTarget:
    def __init__(self, model: torch.nn.Module):
        # keep_vars: the Parameters themselves (tied embeddings appear under both names, same storage).
        self._tensors: Dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))

    @property
    def names(self) -> List[str]:
        return sorted(self._tensors)

    def resolve(self, name: str) -> Optional[torch.Tensor]:
        """The destination tensor (a view for a per-expert name) or None if the model has no such weight."""
        if name in self._tensors:
            return self._tensors[name]
        m = _EXPERT.match(name)
        if m is None:
            return None
        prefix, e, proj = m["prefix"], int(m["e"]), m["proj"]
        if proj == "down_proj":
            fused = self._tensors.get(f"{prefix}.down_proj")
            return None if fused is None or e >= fused.shape[0] else fused[e]
        fused = self._tensors.get(f"{prefix}.gate_up_proj")
        if fused is None or e >= fused.shape[0]:
            return None
        inter = fused.shape[1] // 2
        return fused[e, :inter] if proj == "gate_proj" else fused[e, inter:]

    def slot(self, name: str, shape) -> torch.Tensor:
        """The destination of ``name`` (detached: written in place by a weight sync), checked against the full
        ``shape`` the sender assembles it to; raises :class:`WeightUpdateError`."""
        dst = self.resolve(name)
        if dst is None:
            raise WeightUpdateError(f"weight update: unknown name {name!r}{self._suggest(name)}; the model has "
                                    f"{len(self._tensors)} state-dict tensors")
        if tuple(dst.shape) != tuple(shape):
            raise WeightUpdateError(f"weight update: {name} has shape {tuple(shape)} on the trainer, "
                                    f"{tuple(dst.shape)} in the model")
        return dst.detach()

    def _suggest(self, name: str) -> str:
        close = difflib.get_close_matches(name, self._tensors, n=1, cutoff=0.6)
        return f" (closest: {close[0]!r})" if close else ""

    def copy_bucket(self, bucket: Iterable[Tuple[str, torch.Tensor]]) -> int:
        """Validate then copy one bucket; returns the number of tensors copied."""
        items = list(bucket)
        unknown, bad_shape, bad_type, plan = [], [], [], []
        for name, src in items:
            if not isinstance(name, str) or not isinstance(src, torch.Tensor):
                bad_type.append(f"{name!r}: {type(src).__name__}")
                continue
            dst = self.resolve(name)
            if dst is None:
                unknown.append(name)
            elif tuple(dst.shape) != tuple(src.shape):
                bad_shape.append(f"{name}: got {tuple(src.shape)}, model has {tuple(dst.shape)}")
            else:
                plan.append((dst, src))
        problems = []
        if unknown:
            listed = "; ".join(n + self._suggest(n) for n in unknown[:20])
            more = f" (+{len(unknown) - 20} more)" if len(unknown) > 20 else ""
            problems.append(f"{len(unknown)} unknown name(s): {listed}{more}")
        if bad_shape:
            problems.append("shape mismatch: " + "; ".join(bad_shape[:20]))
        if bad_type:
            problems.append("entries must be (str, torch.Tensor) pairs: " + "; ".join(bad_type[:20]))
        if problems:
            raise WeightUpdateError(
                "weight update bucket rejected, nothing in it was copied: " + " | ".join(problems)
                + f". The model has {len(self._tensors)} state-dict tensors; per-expert HF names"
                " (...experts.<e>.gate_proj/up_proj/down_proj.weight) are accepted for fused experts."
            )
        with torch.no_grad():
            for dst, src in plan:
                dst.copy_(src.to(device=dst.device, dtype=dst.dtype))
        return len(plan)
