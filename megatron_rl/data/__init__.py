"""Prompt data, the tiny synthetic task, and rewards.

  config.py          DataConfig (the ``data.*`` part of the config tree)
  loading.py         jsonl / parquet / saved HF dataset -> datasets.Dataset, columns checked
  prompts.py         PromptDataset: chat template, tokenisation, overlong drop/error; PromptRecord
  sampler.py         PromptSampler: (seed, epoch) permutations, state_dict/load_state_dict resume
  arithmetic.py      single-digit arithmetic problems for the tiny CPU recipe
  tiny_tokenizer.py  make_tiny_tokenizer: a 64-token character-level HF tokenizer, built locally
  tiny_task.py       prepare_tiny_arithmetic: the tiny recipe's tokenizer, data, student and teacher
  rewards/           reward functions, RewardConfig, RewardRunner (worker processes, timeouts)

Names are imported lazily (PEP 562): reward worker processes import this package and must not pay
for ``datasets``/``transformers``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DataConfig": "config",
    "load_prompt_table": "loading",
    "PromptDataset": "prompts", "PromptRecord": "prompts", "render_prompt": "prompts",
    "PromptSampler": "sampler", "epoch_order": "sampler",
    "generate_problems": "arithmetic", "all_problems": "arithmetic", "write_arithmetic_dataset": "arithmetic",
    "make_tiny_tokenizer": "tiny_tokenizer", "build_tiny_tokenizer": "tiny_tokenizer",
    "prepare_tiny_arithmetic": "tiny_task",
    "RewardConfig": "rewards.config", "RewardRunner": "rewards.runner", "RewardResult": "rewards.runner",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
