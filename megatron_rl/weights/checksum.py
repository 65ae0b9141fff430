"""A bucket's checksum: what the sender computed, the receiving server recomputes and refuses the bucket on a
mismatch (before loading any of it).

Two integers over the bucket's bytes, its tensors in name order (a safetensors file comes back in its own order),
read as int16 words
``w_i``: ``sum(w_i)`` and ``sum(w_i * (1 + i % 65521))``. Integer sums are exact, so the result does not depend on
the device or the reduction order (a float64 sum on a GPU and on the receiver's CPU would differ in the last bits
and need a tolerance); the weighted sum catches moved bytes, not only changed ones. Computed where the bucket is
(the trainer's GPU: one reduction per chunk, one host copy of two numbers per bucket); int16 words keep both sums
far below 2**63 for buckets up to 2**30 words (the chunk bound). SGLang takes no checksum: there the probe check
after the sync is the verification.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from megatron_rl.weights.group import flatten

_MOD = 65521  # the weights' period: the largest prime below 2**16
_CHUNK = 1 << 26  # words per reduction: bounds the int64 temporaries at 512 MiB


def bytes_checksum(flat: torch.Tensor) -> List[int]:
    """``[sum, weighted sum]`` of a ``uint8`` buffer (module doc), on its own device."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"bytes_checksum needs a 1-D uint8 buffer, got {flat.dtype} {tuple(flat.shape)}")
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    words = flat.view(torch.int16)
    total = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), _CHUNK):  # chunks of one buffer, not a loop over tensors
        w = words[start:start + _CHUNK].to(torch.int64)
        pos = torch.arange(start, start + w.numel(), dtype=torch.int64, device=flat.device).remainder_(_MOD).add_(1)
        total += torch.stack([w.sum(), (w * pos).sum()])
    return [int(v) for v in total.tolist()]  # the one host copy


def bucket_checksum(bucket: Sequence[Tuple[str, torch.Tensor]]) -> List[int]:
    """The checksum of a bucket's tensors, laid out in name order as :func:`megatron_rl.weights.group.flatten` does."""
    return bytes_checksum(flatten(sorted(bucket, key=lambda item: item[0])))


def verify(bucket: Sequence[Tuple[str, torch.Tensor]], expected) -> None:
    """Raise ``ValueError`` naming both checksums when ``bucket`` is not what the sender checksummed."""
    if not (isinstance(expected, (list, tuple)) and len(expected) == 2 and all(isinstance(v, int) for v in expected)):
        raise ValueError(f"checksum={expected!r}: expected [sum, weighted sum], two integers")
    got = bucket_checksum(bucket)
    if got != list(expected):
        names = [n for n, _ in bucket]
        raise ValueError(f"bucket checksum mismatch: sent {list(expected)}, received {got} (tensors "
                         f"{names[:3]}{'...' if len(names) > 3 else ''}): the bytes changed in transit")
