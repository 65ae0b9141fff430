"""What :func:`megatron_rl.models.build.build_model` returns: the built stage and how this rank shards it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch.distributed as dist

from megatron_rl.models.config import HFArch, ModelConfig, padded_vocab_size


@dataclass(frozen=True)
class Axis:
    """One parallel dimension as this rank sees it."""

    size: int
    rank: int
    group: Optional[dist.ProcessGroup]


@dataclass(frozen=True)
class ShardLayout:
    """Where this rank's shard sits: TP, PP, EP and expert-TP axes and every stage's layer range (and the
    context-parallel axis, which holds no weights but splits every sequence)."""

    tp: Axis
    pp: Axis
    ep: Axis
    etp: Axis
    stage_layers: Tuple[Tuple[int, int], ...]  # per PP stage: (first global layer, number of layers)
    cp: Axis = Axis(1, 0, None)

    def stage_of_layer(self, layer: int) -> int:
        for stage, (first, count) in enumerate(self.stage_layers):
            if first <= layer < first + count:
                return stage
        raise ValueError(f"layer {layer} is on no pipeline stage {self.stage_layers}")


@dataclass
class BuiltModel:
    """A built policy model and everything needed to feed it and move its weights."""

    module: Any  # megatron.core.models.gpt.GPTModel
    cfg: ModelConfig
    arch: HFArch
    tconfig: Any  # megatron.core.transformer.TransformerConfig
    shard: ShardLayout

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.arch.vocab_size, self.cfg.vocab_divisor, self.shard.tp.size)

    @property
    def pre_process(self) -> bool:
        return self.shard.pp.rank == 0

    @property
    def post_process(self) -> bool:
        return self.shard.pp.rank == self.shard.pp.size - 1

    def layers(self) -> List[Tuple[int, Any]]:
        """``(global layer index, TransformerLayer)`` for this stage's layers."""
        return [(layer.layer_number - 1, layer) for layer in self.module.decoder.layers]
