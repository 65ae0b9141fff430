"""Vocabulary-parallel ops over sharded logits ``[*, V_local]`` (math_spec §1.2).

Each op is one ``torch.autograd.Function``: fused and chunked along the rows, one all-reduce MAX and
one stacked all-reduce SUM per chunk, backward without communication. The ``vocab_parallel_linear_*``
twins take the output layer's input ``[*, H]`` and weight shard ``[V_local, H]`` instead and never hold
more than one ``[chunk, V_local]`` block of logits (:mod:`megatron_rl.ops.linear`; Triton row kernels on
GPU, :mod:`megatron_rl.ops.triton_head`).
"""

from megatron_rl.ops.kl import vocab_parallel_kl
from megatron_rl.ops.linear import vocab_parallel_linear_kl, vocab_parallel_linear_stats
from megatron_rl.ops.stats import VocabStats, vocab_parallel_stats

__all__ = ["VocabStats", "vocab_parallel_stats", "vocab_parallel_kl", "vocab_parallel_linear_stats",
           "vocab_parallel_linear_kl"]
