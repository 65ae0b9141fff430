"""Prompt dataset: rendered (optionally through a chat template), tokenised and length-filtered once.

Everything is computed up front with ``datasets.map`` so that (a) the number of usable prompts is
known before training starts — the sampler's permutation and its checkpointed position are defined
over exactly that set — and (b) an overlong prompt in ``overlong_policy="error"`` mode stops the run
at start-up, not hours in. The token ids live in the (memory-mapped) Arrow table, not Python lists.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import datasets
import numpy as np

from megatron_rl.data.config import DataConfig
from megatron_rl.data.loading import load_prompt_table

logger = logging.getLogger(__name__)

# Internal column names; the leading underscore keeps them clear of user columns.
_IDS, _TEXT, _LEN, _INDEX = "_prompt_ids", "_prompt_text", "_num_tokens", "_index"


@dataclass(frozen=True)
class PromptRecord:
    """One prompt, ready for the rollout engine and (through ``label``) for the reward.

    index:       row number in the source table (stable across overlong drops and shuffling).
    prompt_ids:  token ids fed to the engine (``P`` tokens, ``P <= max_prompt_tokens``).
    prompt_text: the text those ids encode (after the chat template, if any).
    label:       the ``label_field`` value, as stored (``None`` without a label field).
    metadata:    the ``metadata_fields`` values, passed to the reward as keyword arguments.
    """

    index: int
    prompt_ids: Tuple[int, ...]
    prompt_text: str
    label: Any = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


class PromptDataset:
    """The usable prompts of ``config.path``, tokenised with ``tokenizer`` (any HF tokenizer).

    ``len(ds)`` counts prompts kept; ``ds.dropped_overlong`` counts those dropped for exceeding
    ``max_prompt_tokens`` (always 0 with ``overlong_policy="error"``, which raises instead).
    Positions ``0..len(ds)-1`` index the kept prompts; ``PromptRecord.index`` is the source row.
    """

    def __init__(self, config: DataConfig, tokenizer: Any):
        if config.apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"data.apply_chat_template=True but the tokenizer "
                             f"{getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r} has no "
                             "chat_template; set data.apply_chat_template=False or use a tokenizer that has one")
        self.config = config
        table = load_prompt_table(config)
        self.num_source_rows = len(table)
        table = table.map(
            _tokenize_batch, batched=True, with_indices=True, fn_kwargs={"tokenizer": tokenizer, "config": config},
            desc="tokenising prompts",
        )
        keep_columns = [_IDS, _TEXT, _LEN, _INDEX]
        if config.label_field is not None:
            keep_columns.append(config.label_field)
        keep_columns += list(config.metadata_fields)
        table = table.select_columns(keep_columns)
        self.dropped_overlong = 0
        self._table = self._filter_overlong(table)

    def _filter_overlong(self, table: datasets.Dataset) -> datasets.Dataset:
        limit = self.config.max_prompt_tokens
        lengths = np.asarray(table.with_format("numpy")[_LEN])
        empty = np.flatnonzero(lengths == 0)
        if empty.size:  # the engine needs >= 1 prompt token; an empty prompt is a data bug, not a length
            raise ValueError(f"prompt at index {int(empty[0])} of {self.config.path!r} encodes to 0 tokens "
                             f"({empty.size} such rows); remove empty prompts from the data")
        overlong = np.flatnonzero(lengths > limit)
        if overlong.size == 0:
            return table
        first = int(overlong[0])
        if self.config.overlong_policy == "error":
            raise ValueError(
                f"prompt at index {first} of {self.config.path!r} has {int(lengths[first])} tokens > "
                f"data.max_prompt_tokens={limit} ({overlong.size} of {len(table)} prompts are over; the longest "
                f"has {int(lengths.max())}). Raise data.max_prompt_tokens or set data.overlong_policy='drop'")
        self.dropped_overlong = int(overlong.size)
        if self.dropped_overlong == len(table):
            raise ValueError(f"all {len(table)} prompts of {self.config.path!r} exceed data.max_prompt_tokens="
                             f"{limit} (the shortest has {int(lengths.min())} tokens); raise max_prompt_tokens")
        logger.warning("dropped %d of %d prompts longer than data.max_prompt_tokens=%d (first: index %d, %d tokens)",
                       self.dropped_overlong, len(table), limit, first, int(lengths[first]))
        return table.select(np.flatnonzero(lengths <= limit))

    def __len__(self) -> int:
        return len(self._table)

    def __getitem__(self, position: int) -> PromptRecord:
        return self.records([position])[0]

    def records(self, positions: Sequence[int]) -> List[PromptRecord]:
        """The records at ``positions`` (kept-prompt positions, any order, repeats allowed)."""
        positions = [int(p) for p in positions]
        for p in positions:
            if not 0 <= p < len(self):
                raise IndexError(f"prompt position {p} out of range [0, {len(self)})")
        if not positions:
            return []
        rows = self._table[positions]  # one Arrow take for the whole batch
        label_field, meta = self.config.label_field, self.config.metadata_fields
        return [
            PromptRecord(
                index=int(rows[_INDEX][i]),
                prompt_ids=tuple(int(t) for t in rows[_IDS][i]),
                prompt_text=rows[_TEXT][i],
                label=rows[label_field][i] if label_field is not None else None,
                metadata={name: rows[name][i] for name in meta},
            )
            for i in range(len(positions))
        ]

    @property
    def stats(self) -> Dict[str, float]:
        """Start-up numbers for the run log."""
        lengths = np.asarray(self._table.with_format("numpy")[_LEN])
        return {"data/num_prompts": float(len(self)), "data/dropped_overlong": float(self.dropped_overlong),
                "data/prompt_tokens_mean": float(lengths.mean()), "data/prompt_tokens_max": float(lengths.max())}


def render_prompt(prompt: Any, config: DataConfig, tokenizer: Any, index: Optional[int] = None) -> str:
    """The text the model sees for one ``prompt_field`` value (chat template applied if configured)."""
    where = f" (row {index})" if index is not None else ""
    system = config.system_prompt
    if isinstance(prompt, str):
        if not config.apply_chat_template:
            return (system or "") + prompt
        messages = [{"role": "user", "content": prompt}]
    elif _is_messages(prompt):
        if not config.apply_chat_template:
            raise ValueError(f"data.prompt_field={config.prompt_field!r}{where} holds chat messages but "
                             "data.apply_chat_template=False; set it to True to render them")
        messages = [dict(m) for m in prompt]
    else:
        raise ValueError(f"data.prompt_field={config.prompt_field!r}{where} holds {type(prompt).__name__} "
                         f"{str(prompt)[:80]!r}; expected a string or a list of {{'role', 'content'}} messages")
    if system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _is_messages(value: Any) -> bool:
    return (isinstance(value, list) and len(value) > 0
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in value))


def _tokenize_batch(batch: Dict[str, list], indices: List[int], tokenizer: Any, config: DataConfig) -> Dict[str, list]:
    texts = [render_prompt(p, config, tokenizer, i) for p, i in zip(batch[config.prompt_field], indices)]
    # A chat template already places BOS and friends; adding the tokenizer's own would double them.
    ids = tokenizer(texts, add_special_tokens=not config.apply_chat_template)["input_ids"]
    return {_IDS: ids, _TEXT: texts, _LEN: [len(x) for x in ids], _INDEX: list(indices)}
