"""Where the trainer's tensors live: a micro-batch goes to the device once, in one pass over its fields
(host -> device copies once per micro-batch, never per sequence); results go back to the host once, at
the driver boundary. On CPU both are no-ops."""

from __future__ import annotations

import dataclasses
from typing import List

import torch

from megatron_rl.training.micro_batch import MicroBatch


def micro_batch_to(mb: MicroBatch, device: torch.device) -> MicroBatch:
    """``mb`` with every tensor field on ``device`` (``non_blocking``: host -> device copies may overlap)."""
    moved = {f.name: getattr(mb, f.name).to(device, non_blocking=True) for f in dataclasses.fields(mb)
             if isinstance(getattr(mb, f.name), torch.Tensor)}
    return dataclasses.replace(mb, **moved)


def micro_batches_to(mbs: List[MicroBatch], device: torch.device) -> List[MicroBatch]:
    return [micro_batch_to(mb, device) for mb in mbs]
