"""Deterministic, checkpointable prompt order.

The order of epoch ``e`` is a pure function of ``(seed, e)`` (a fresh NumPy PCG64 stream seeded with
both), so the sampler's whole state is two integers: the epoch and the position inside it. Saving
``state_dict()`` and loading it into a new sampler over the same dataset continues with exactly the
prompts the old one would have produced next — mid-epoch or across an epoch boundary — without storing
a permutation. (NumPy does not promise identical ``Generator`` streams across major versions; resume
with the NumPy version the checkpoint was written with.)
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np

from megatron_rl.data.prompts import PromptDataset, PromptRecord

_STATE_KEYS = ("epoch", "index", "seed", "shuffle", "num_prompts")


def epoch_order(num_prompts: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """Positions ``0..num_prompts-1`` in the order epoch ``epoch`` visits them."""
    if not shuffle:
        return np.arange(num_prompts)
    return np.random.Generator(np.random.PCG64([seed, epoch])).permutation(num_prompts)


class PromptSampler:
    """Hands out prompts in batches, epoch after epoch, in a reproducible order.

    ``next_batch(n)`` returns ``n`` records; a batch that reaches the end of an epoch continues from
    the start of the next epoch's order (so batches always have ``n`` records, and a prompt can appear
    in one batch at most once per epoch it spans). ``epoch`` and ``consumed`` are for logging.
    """

    def __init__(self, dataset: PromptDataset, *, shuffle: bool = True, seed: int = 0):
        if len(dataset) == 0:
            raise ValueError("PromptSampler needs a dataset with at least one prompt")
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        self.index = 0  # position inside the current epoch's order
        self.consumed = 0  # prompts handed out in total (restored by load_state_dict)
        self._order: Optional[np.ndarray] = None

    @classmethod
    def from_config(cls, dataset: PromptDataset) -> "PromptSampler":
        """A sampler with the dataset's ``data.shuffle`` and ``data.seed``."""
        return cls(dataset, shuffle=dataset.config.shuffle, seed=dataset.config.seed)

    def _current_order(self) -> np.ndarray:
        if self._order is None:
            self._order = epoch_order(len(self.dataset), self.epoch, self.seed, self.shuffle)
        return self._order

    def next_positions(self, n_prompts: int) -> List[int]:
        """Dataset positions of the next ``n_prompts`` prompts, advancing the sampler."""
        if isinstance(n_prompts, bool) or not isinstance(n_prompts, int) or n_prompts < 1:
            raise ValueError(f"next_batch(n_prompts={n_prompts!r}): expected an integer >= 1")
        out: List[int] = []
        while len(out) < n_prompts:
            order = self._current_order()
            take = min(n_prompts - len(out), len(order) - self.index)
            out.extend(int(p) for p in order[self.index:self.index + take])
            self.index += take
            if self.index == len(order):  # wrap: the next prompt comes from the next epoch's order
                self.epoch, self.index, self._order = self.epoch + 1, 0, None
        self.consumed += n_prompts
        return out

    def next_batch(self, n_prompts: int) -> List[PromptRecord]:
        """The next ``n_prompts`` records (prompt ids, prompt text, label, source index)."""
        return self.dataset.records(self.next_positions(n_prompts))

    def state_dict(self) -> Dict[str, Any]:
        """The data position, plus what it is only valid for (seed, shuffle, dataset size)."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "shuffle": self.shuffle,
                "num_prompts": len(self.dataset), "consumed": self.consumed}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from ``state``; refuses a state made for a different seed, order or dataset size,
        because the position would then silently point at different prompts."""
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"PromptSampler state is missing {missing}; expected keys {list(_STATE_KEYS)} "
                             "as written by state_dict()")
        if int(state["num_prompts"]) != len(self.dataset):
            raise ValueError(
                f"PromptSampler state was saved over {state['num_prompts']} prompts but this dataset has "
                f"{len(self.dataset)}; the data position cannot be restored. Use the same data.path, "
                "data.max_prompt_tokens and tokenizer as the checkpointed run")
        if int(state["seed"]) != self.seed or bool(state["shuffle"]) != self.shuffle:
            raise ValueError(
                f"PromptSampler state has seed={state['seed']}, shuffle={state['shuffle']} but this sampler has "
                f"seed={self.seed}, shuffle={self.shuffle}; set data.seed/data.shuffle as in the checkpointed run")
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < len(self.dataset):
            raise ValueError(f"PromptSampler state epoch={epoch}, index={index} is out of range for "
                             f"{len(self.dataset)} prompts")
        self.epoch, self.index, self._order = epoch, index, None
        self.consumed = int(state.get("consumed", 0))
