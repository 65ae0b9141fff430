"""The prompt data's part of the config tree (``data.*``), validated when constructed.

Only checks that need nothing but the config live here (types, ranges, that the path exists and has a
format we read). Checks that need the file's contents — the prompt and label columns exist — run when
the table is loaded (:func:`megatron_rl.data.loading.load_prompt_table`) and name the columns found.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass
from typing import Iterator, Literal, Optional, Tuple

DataFormat = Literal["auto", "jsonl", "parquet", "hf_disk"]
OverlongPolicy = Literal["drop", "error"]

_FORMATS = ("auto", "jsonl", "parquet", "hf_disk")
_POLICIES = ("drop", "error")
# File extensions the "auto" format understands; `.json` is read as JSON lines too (the `datasets`
# json builder accepts both one-object-per-line and a top-level list).
EXTENSION_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
# Files `Dataset.save_to_disk` / `DatasetDict.save_to_disk` always write at the top of the directory.
HF_DISK_MARKERS = ("state.json", "dataset_dict.json")


_DEFER_PATH_CHECK: contextvars.ContextVar[bool] = contextvars.ContextVar("defer_data_path_check", default=False)


@contextlib.contextmanager
def deferred_path_checks() -> Iterator[None]:
    """Inside, a :class:`DataConfig` whose path does not exist is still built, so that ``--dry-run`` lists a
    missing data file together with every other problem (``check_prompt_file`` reports it) instead of alone."""
    token = _DEFER_PATH_CHECK.set(True)
    try:
        yield
    finally:
        _DEFER_PATH_CHECK.reset(token)


def missing_path_message(section: str, path: str) -> str:
    return (f"{section}.path={path!r} does not exist (cwd: {os.getcwd()}); point it at a .jsonl/.parquet file or a "
            "directory written by Dataset.save_to_disk (math data: `python tools/prepare_math_data.py gsm8k "
            "--split train --out data/gsm8k_train.jsonl`, --split test for the eval file)")


@dataclass(frozen=True)
class DataConfig:
    """Where the prompts come from and how they become token ids.

    path:               a ``.jsonl``/``.json`` or ``.parquet`` file, or a directory written by
                        ``datasets.Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``).
    format:             ``"auto"`` picks by extension / directory; set it for unusual file names.
    split:              which split of a saved ``DatasetDict`` to use (ignored for a single dataset).
    prompt_field:       column holding the prompt: a string, or a list of ``{"role", "content"}``
                        messages (the latter needs ``apply_chat_template=True``).
    label_field:        column holding the reference answer handed to the reward; ``None`` for none.
    metadata_fields:    further columns carried into each record (and on to the reward function as
                        keyword arguments), e.g. ``("data_source", "tests")``.
    system_prompt:      with a chat template: a system message put first (unless the row's messages
                        already start with one). Without a template: prepended verbatim to the prompt.
    apply_chat_template: render with ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``;
                        the rendered text is then encoded without extra special tokens, because the
                        template already places them. Without a template the tokenizer's own special
                        tokens (e.g. a BOS) are added as ``tokenizer(text)`` does.
    max_prompt_tokens:  prompts longer than this (after rendering) are dropped or rejected.
    overlong_policy:    ``"drop"`` (count them: ``PromptDataset.dropped_overlong``) or ``"error"``.
    shuffle, seed:      the sampler's epoch permutation is a pure function of ``(seed, epoch)``.
    cache_dir:          where ``datasets`` keeps its Arrow copy of a jsonl/parquet file and the
                        tokenised table (``None``: ``HF_DATASETS_CACHE``). A saved dataset directory
                        keeps its own cache files beside it, as ``datasets`` does.
    """

    path: str
    format: DataFormat = "auto"
    split: str = "train"
    prompt_field: str = "prompt"
    label_field: Optional[str] = "answer"
    metadata_fields: Tuple[str, ...] = ()
    system_prompt: Optional[str] = None
    apply_chat_template: bool = False
    max_prompt_tokens: int = 1024
    overlong_policy: OverlongPolicy = "drop"
    shuffle: bool = True
    seed: int = 0
    cache_dir: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise ValueError(f"data.path={self.path!r}: expected the path of a .jsonl/.parquet file or a "
                             "saved HF dataset directory")
        object.__setattr__(self, "path", os.fspath(self.path))
        # YAML gives lists; keep the frozen config hashable.
        object.__setattr__(self, "metadata_fields", tuple(self.metadata_fields))
        if self.format not in _FORMATS:
            raise ValueError(f"data.format={self.format!r}: expected one of {_FORMATS}")
        if self.overlong_policy not in _POLICIES:
            raise ValueError(f"data.overlong_policy={self.overlong_policy!r}: expected 'drop' (skip and "
                             "count overlong prompts) or 'error' (stop at the first one)")
        if isinstance(self.max_prompt_tokens, bool) or not isinstance(self.max_prompt_tokens, int) \
                or self.max_prompt_tokens < 1:
            raise ValueError(f"data.max_prompt_tokens={self.max_prompt_tokens!r}: expected an integer >= 1")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"data.seed={self.seed!r}: expected an integer >= 0")
        if not self.prompt_field:
            raise ValueError("data.prompt_field is empty: name the column that holds the prompt")
        for name in self.metadata_fields:
            if name in (self.prompt_field, self.label_field):
                raise ValueError(f"data.metadata_fields contains {name!r}, which is already the prompt or "
                                 "label field; remove it from metadata_fields")
        if not os.path.exists(self.path):
            if _DEFER_PATH_CHECK.get():  # load_run_config: reported with every other problem by the file checks
                return
            raise ValueError(missing_path_message("data", self.path))
        self.resolved_format()  # raises for an extension/directory we cannot read

    def resolved_format(self) -> str:
        """The concrete format: ``format`` itself, or what ``"auto"`` infers from the path."""
        if self.format != "auto":
            return self.format
        if os.path.isdir(self.path):
            if any(os.path.exists(os.path.join(self.path, m)) for m in HF_DISK_MARKERS):
                return "hf_disk"
            raise ValueError(f"data.path={self.path!r} is a directory but not one written by "
                             f"Dataset.save_to_disk (none of {HF_DISK_MARKERS} in it); point data.path at "
                             "a single .jsonl/.parquet file or at a saved dataset directory")
        ext = os.path.splitext(self.path)[1].lower()
        if ext not in EXTENSION_FORMATS:
            raise ValueError(f"data.path={self.path!r}: cannot infer the format from extension {ext!r}; "
                             f"expected one of {sorted(EXTENSION_FORMATS)} or set data.format to "
                             "'jsonl' or 'parquet'")
        return EXTENSION_FORMATS[ext]
