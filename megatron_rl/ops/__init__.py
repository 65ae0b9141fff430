"""Vocabulary-parallel ops over sharded logits ``[*, V_local]`` (math_spec §1.2).

Each op is one ``torch.autograd.Function``: fused and chunked along the rows, one all-reduce MAX and
one stacked all-reduce SUM per chunk, backward without communication.
"""

from megatron_rl.ops.kl import vocab_parallel_kl
from megatron_rl.ops.linear import vocab_parallel_linear_kl, vocab_parallel_linear_stats
from megatron_rl.ops.stats import VocabStats, vocab_parallel_stats

__all__ = ["VocabStats", "vocab_parallel_stats", "vocab_parallel_kl", "vocab_parallel_linear_stats", "vocab_parallel_linear_kl"]
