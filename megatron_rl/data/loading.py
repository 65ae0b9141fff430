"""Read a prompt table (jsonl, parquet or a saved HF dataset) into a ``datasets.Dataset``.

All three go through ``datasets`` so that large tables stay memory-mapped Arrow and later steps
(tokenising, dropping overlong rows) are the same whatever the source was.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, List, Tuple

import datasets

from megatron_rl.data.config import DataConfig, missing_path_message
from megatron_rl.data.labels import mixed_columns, with_exact_values
from megatron_rl.data.file_checks import check_regular_file, read_jsonl_text


def load_prompt_table(config: DataConfig) -> datasets.Dataset:
    """The raw table named by ``config.path``, checked to have the prompt, label and metadata columns.

    Raises ``ValueError`` naming the missing column and listing the columns that are there.
    """
    check_regular_file(config.path, f"data.path={config.path!r}")  # a FIFO would block, /dev/zero never end
    fmt = config.resolved_format()
    if fmt == "jsonl":
        check_prompt_file(config)  # a clear error for an empty file or a broken line, not the json builder's
        # The packaged "json" builder is local (no hub access); it caches an Arrow copy of the file.
        table = datasets.load_dataset("json", data_files=config.path, split="train", cache_dir=config.cache_dir)
        mixed = mixed_columns(table, [c for c in (config.label_field, *config.metadata_fields) if c is not None])
        if mixed:  # "02" beside 4 would come back as 2: the values as parsed here instead
            rows = [row for _, row in _jsonl_rows(config.path, f"data.path={config.path!r}")]
            for name in mixed:
                table = with_exact_values(table, name, [row.get(name) for row in rows])
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


def check_prompt_file(config: DataConfig, section: str = "data") -> None:
    """Check the prompt table without a tokenizer (what ``--dry-run`` reads): it can be read, has rows, and every
    row has the prompt, label and metadata columns. Raises ``ValueError`` naming the file (and the line of a
    jsonl file), what is wrong and the fix. ``section``: the config path for messages (``data``, ``eval.data``)."""
    where = f"{section}.path={config.path!r}"
    if not os.path.exists(config.path):
        raise ValueError(missing_path_message(section, config.path))
    check_regular_file(config.path, where)
    fmt = config.resolved_format()
    if fmt == "jsonl":
        rows = _jsonl_rows(config.path, where)
    else:
        try:
            if fmt == "parquet":
                import pyarrow.parquet as pq

                try:
                    meta = pq.ParquetFile(config.path).metadata
                except ValueError as e:  # pyarrow's ArrowInvalid is a ValueError naming no file
                    raise OSError(str(e)) from None
                columns, n = list(meta.schema.names), meta.num_rows
            else:
                table = _load_saved(config)
                columns, n = table.column_names, len(table)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - pyarrow / datasets errors of a damaged file
            raise ValueError(f"{where} cannot be read as {fmt} ({type(e).__name__}: {e}); check the file") from None
        rows = [(0, {c: "" for c in columns})] if n else []
    if not rows:
        raise ValueError(f"{where} has no rows; give a file with at least one prompt")
    wanted = [("prompt_field", config.prompt_field)]
    if config.label_field is not None:
        wanted.append(("label_field", config.label_field))
    wanted += [("metadata_fields", name) for name in config.metadata_fields]
    for line, row in rows:
        for option, column in wanted:
            if column not in row or (option == "prompt_field" and row[column] is None):
                at = f" (line {line})" if fmt == "jsonl" else ""
                hint = " (or None for no label)" if option == "label_field" else ""
                raise ValueError(f"{section}.{option}: column {column!r} is not in {config.path!r}{at}; available "
                                 f"columns: {list(row)}. Set {section}.{option} to one of them{hint}, or fix the data")


def _jsonl_rows(path: str, where: str) -> List[Tuple[int, dict]]:
    """``(line number, row)`` of a JSON-lines file (or a ``.json`` file holding one list of objects)."""
    text = read_jsonl_text(path, where)
    data = None
    if text.lstrip().startswith("["):  # one JSON array (``.json``), or JSON lines that are arrays
        try:
            data = json.loads(text)
        except ValueError:
            pass
    if isinstance(data, list):
        rows: Iterable[Tuple[int, object]] = enumerate(data, start=1)
        unit = "item"
    else:
        rows, unit = [], "line"
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append((number, json.loads(line)))
            except ValueError as e:
                raise ValueError(f"{where} line {number}: not valid JSON ({e}): {line[:80]!r}; fix or remove "
                                 "that line") from None
    out = []
    for number, row in rows:
        if not isinstance(row, dict):
            raise ValueError(f"{where} {unit} {number}: a {type(row).__name__}, not an object with named "
                             "columns; each row must be a JSON object such as {\"prompt\": ..., \"answer\": ...}")
        out.append((number, row))
    return out
