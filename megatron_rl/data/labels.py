"""Labels keep the type they have in the file. ``datasets`` stores a JSON-lines column of mixed types (``"02"``
and ``4``) as its ``Json`` feature but keeps a string that parses as JSON unquoted, so ``"02"`` is read back as
the integer 2 and an exact-match reward changes without a word. Such columns are re-encoded here from the
file's own parse: every value as its JSON text, which the ``Json`` feature decodes to exactly that value."""

from __future__ import annotations

import json
from typing import Any, List, Sequence

import datasets
import pyarrow as pa


def mixed_columns(table: datasets.Dataset, names: Sequence[str]) -> List[str]:
    """The columns among ``names`` that ``datasets`` read with its (lossy) ``Json`` feature."""
    return [n for n in names if isinstance(table.features.get(n), datasets.Json)]


def with_exact_values(table: datasets.Dataset, name: str, values: Sequence[Any]) -> datasets.Dataset:
    """``table`` with column ``name`` replaced by ``values`` (one per row, as parsed from the file), each
    decoded back as exactly that value."""
    if len(values) != len(table):
        raise ValueError(f"column {name!r}: {len(values)} values parsed from the file but the table has "
                         f"{len(table)} rows")
    column = pa.array([json.dumps(v) for v in values], type=pa.json_())
    return table.remove_columns(name).add_column(name, column, feature=datasets.Json())
