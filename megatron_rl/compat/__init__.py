"""CPU compatibility layer for Megatron-Core 0.16.1 to 0.19.2 on a machine without CUDA (0.17+ only: ``mcore019.py``).

Megatron-Core assumes a CUDA device in many places (each patch below names the one it works around).
Every workaround we need lives here, registered with :func:`_patch` together with a one-line reason and the
condition under which it can be deleted. Nothing is patched at import time: :func:`apply` does it,
once, and only when ``torch.cuda.is_available()`` is false — on a GPU machine it does nothing.

Patches are as narrow as we could make them: a single function or attribute is wrapped, a ``torch``
name is shimmed inside one Megatron module only, or a global is swapped only for the duration of one
Megatron call. Two CUDA assumptions are avoided rather than patched: the stock ``DotProductAttention``
(CUDA causal-mask helper) and ``WrappedTorchNorm`` (asserts no sequence parallelism) are simply not
used by our portable layer spec (:mod:`megatron_rl.models.spec`), which brings its own SDPA core
attention and RMSNorm.

:func:`applied_patches` lists what was applied (for ``megatron-rl diagnose`` and bug reports).
``torch.cuda.current_device`` and ``torch.cuda.synchronize`` are replaced process-wide; on a CPU
build both only raised before, so nothing that worked changes behaviour.

Verified on CPU with these patches (tests/distributed): GPTModel forward/backward at TP, PP (1F1B,
tied embeddings), EP with the alltoall and allgather dispatchers, expert-TP; Megatron DDP,
``finalize_model_grads``, the Megatron and the distributed optimizer with grad clipping;
dist-checkpointing save/load (checked by hand: its writer needs non-daemonic ranks). Not covered:
``num_distributed_optimizer_instances > 1`` (CUDA streams), CUDA graphs. Context parallelism runs with
the portable core attention (:mod:`megatron_rl.models.attention`) and the RoPE patch below.
"""

from __future__ import annotations

from megatron_rl.compat import cpu_patches, mcore019  # noqa: F401  (registers the patches, in this order)
from megatron_rl.compat.cpu_patches import _vectorised_thd_rope
from megatron_rl.compat.registry import PATCHES, applied_patches, apply, is_applied

__all__ = ["apply", "applied_patches", "is_applied", "vectorise_thd_rope", "PATCHES"]


def vectorise_thd_rope() -> None:
    """Install the vectorised packed-sequence RoPE on any device (CUDA included: Megatron's loop over the
    sequences costs launches and host syncs there too; Transformer Engine's fused RoPE does not use it)."""
    _vectorised_thd_rope()
