"""Known upstream warnings, one line instead of many.

Importing Megatron-Core without Transformer Engine and Apex (every CPU machine) warns four times, once per
module that falls back to its local kernels, and its dist-checkpointing warns on torch's ShardedTensor
deprecation; each repeats in every Ray worker. They say nothing a user can act on, so the command line
(:func:`install`) shows the first of each kind as one short line and drops the rest; any other warning is
shown as usual. Worker processes (Ray actors, the engine server) inherit ``PYTHONWARNINGS`` entries that
ignore them: the driver's line already said it.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Dict, Tuple

# message prefix -> (category, the one line shown instead)
KNOWN: Dict[str, Tuple[type, str]] = {
    "Transformer Engine and Apex are not installed": (
        UserWarning, "Megatron-Core without Transformer Engine / Apex: its local (PyTorch) kernels are used"),
    "Please use DTensor instead and we are deprecating ShardedTensor": (
        FutureWarning, "torch deprecates ShardedTensor, which Megatron-Core's dist-checkpointing uses"),
}
_shown: set = set()


def known(message: str, category: type) -> str | None:
    """The one-line note for a known upstream warning, or None for any other."""
    for prefix, (cat, note) in KNOWN.items():
        if issubclass(category, cat) and message.startswith(prefix):
            return note
    return None


def install() -> None:
    """Show each known upstream warning kind once, as one line; pass every other warning through."""
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        note = known(str(message), category)
        if note is None:
            return previous(message, category, filename, lineno, file, line)
        if note not in _shown:
            _shown.add(note)
            print(f"note: {note} (upstream warning, shown once)", file=sys.stderr)

    warnings.showwarning = show
    for prefix, (cat, _) in KNOWN.items():
        warnings.filterwarnings("always", message=prefix, category=cat)  # reach show() in every module
    entries = [f"ignore:{prefix}:{cat.__name__}" for prefix, (cat, _) in KNOWN.items()]
    current = os.environ.get("PYTHONWARNINGS", "")
    os.environ["PYTHONWARNINGS"] = ",".join([e for e in current.split(",") if e and e not in entries] + entries)
