"""Vocabulary-parallel ops over sharded logits ``[*, V_local]`` (math_spec §1.2).

Each op is one ``torch.autograd.Function``: fused and chunked along the rows, one all-reduce MAX and
one stacked all-reduce SUM per chunk, backward without communication. The ``vocab_parallel_linear_*``
twins take the output layer's input ``[*, H]`` and weight shard ``[V_local, H]`` instead and never hold
more than one ``[chunk, V_local]`` block of logits (:mod:`megatron_rl.ops.linear`; Triton row kernels on
GPU, :mod:`megatron_rl.ops.triton_head`).

  stats.py        vocab_parallel_stats: per-token log-prob, entropy, sum pi^2, DVP-pruned log-prob
  kl.py           vocab_parallel_kl: exact per-token KL (and total variation) between two sharded policies
  linear.py       the same from the output layer's input and weight shard, one logits block at a time
  triton_head.py  the Triton row kernels behind linear.py on GPU
  _shard.py       what every op shares: shard geometry, input validation, chunking, row reductions
"""

from megatron_rl.ops.kl import vocab_parallel_kl
from megatron_rl.ops.linear import vocab_parallel_linear_kl, vocab_parallel_linear_stats
from megatron_rl.ops.stats import VocabStats, vocab_parallel_stats

__all__ = ["VocabStats", "vocab_parallel_stats", "vocab_parallel_kl", "vocab_parallel_linear_stats",
           "vocab_parallel_linear_kl"]
