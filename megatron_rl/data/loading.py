"""Read a prompt table (jsonl, parquet or a saved HF dataset) into a ``datasets.Dataset``.

All three go through ``datasets`` so that large tables stay memory-mapped Arrow and later steps
(tokenising, dropping overlong rows) are the same whatever the source was.
"""

from __future__ import annotations

import datasets

from megatron_rl.data.config import DataConfig


def load_prompt_table(config: DataConfig) -> datasets.Dataset:
    """The raw table named by ``config.path``, checked to have the prompt, label and metadata columns.

    Raises ``ValueError`` naming the missing column and listing the columns that are there.
    """
    fmt = config.resolved_format()
    if fmt == "jsonl":
        # The packaged "json" builder is local (no hub access); it caches an Arrow copy of the file.
        table = datasets.load_dataset("json", data_files=config.path, split="train", cache_dir=config.cache_dir)
    elif fmt == "parquet":
        table = datasets.load_dataset("parquet", data_files=config.path, split="train", cache_dir=config.cache_dir)
    elif fmt == "hf_disk":
        table = _load_saved(config)
    else:  # DataConfig validated the format; reaching here is a bug.
        raise AssertionError(fmt)
    _check_columns(table, config)
    return table


def _load_saved(config: DataConfig) -> datasets.Dataset:
    loaded = datasets.load_from_disk(config.path)
    if isinstance(loaded, datasets.DatasetDict):
        if config.split not in loaded:
            raise ValueError(f"data.split={config.split!r}: the saved DatasetDict at {config.path!r} has "
                             f"splits {sorted(loaded)}; set data.split to one of them")
        loaded = loaded[config.split]
    if not isinstance(loaded, datasets.Dataset):
        raise ValueError(f"data.path={config.path!r} holds a {type(loaded).__name__}, expected a Dataset "
                         "or DatasetDict written by save_to_disk")
    return loaded


def _check_columns(table: datasets.Dataset, config: DataConfig) -> None:
    columns = table.column_names
    wanted = [("prompt_field", config.prompt_field)]
    if config.label_field is not None:
        wanted.append(("label_field", config.label_field))
    wanted += [("metadata_fields", name) for name in config.metadata_fields]
    for option, column in wanted:
        if column not in columns:
            hint = " (or None for no label)" if option == "label_field" else ""
            raise ValueError(f"data.{option}: column {column!r} is not in {config.path!r}; available "
                             f"columns: {columns}. Set data.{option} to one of them{hint}")
    if len(table) == 0:
        raise ValueError(f"data.path={config.path!r} has no rows")
