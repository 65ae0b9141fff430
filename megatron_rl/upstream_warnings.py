"""Known upstream warnings, one line instead of many.

Importing Megatron-Core without Transformer Engine and Apex (every CPU machine) warns five times, once per
module that falls back to its local kernels, its TransformerConfig about its own cuda_graph_scope default,
and its dist-checkpointing on torch's ShardedTensor and load_state_dict deprecations; each repeats in every
Ray worker. They say nothing a user can act on, so the command line (:func:`install`) replaces them all by
one line, printed at the first; any other warning is shown as usual. Worker processes (Ray actors, the
engine server) inherit ``PYTHONWARNINGS`` entries that ignore them.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Dict, Tuple

# message prefix -> (category, the one line shown instead)
_NO_TE = "Megatron-Core without Transformer Engine / Apex: its local (PyTorch) kernels are used"
_DCP = "torch deprecates APIs Megatron-Core's dist-checkpointing uses (ShardedTensor, load_state_dict)"
KNOWN: Dict[str, Tuple[type, str]] = {
    "Transformer Engine and Apex are not installed": (UserWarning, _NO_TE),
    "Apex is not installed": (UserWarning, _NO_TE),
    "Please use DTensor instead and we are deprecating ShardedTensor": (FutureWarning, _DCP),
    "`load_state_dict` is deprecated and will be removed": (FutureWarning, _DCP),
    # Megatron-Core's own default (cuda_graph_scope "full") warns about itself; no CUDA graphs here
    "full scope is deprecated": (UserWarning, "Megatron-Core warns about its own cuda_graph_scope default"),
}
_shown: set = set()


def known(message: str, category: type) -> str | None:
    """The one-line note for a known upstream warning, or None for any other."""
    for prefix, (cat, note) in KNOWN.items():
        if issubclass(category, cat) and message.startswith(prefix):
            return note
    return None


def install() -> None:
    """Replace the known upstream warnings by one line (at the first); pass every other warning through."""
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        note = known(str(message), category)
        if note is None:
            return previous(message, category, filename, lineno, file, line)
        if not _shown:  # one line for them all, on the first
            print("note: known upstream warnings hidden (megatron_rl/upstream_warnings.py): "
                  + "; ".join(dict.fromkeys(n for _, n in KNOWN.values())), file=sys.stderr)
        _shown.add(note)

    warnings.showwarning = show
    for prefix, (cat, _) in KNOWN.items():
        warnings.filterwarnings("always", message=prefix, category=cat)  # reach show() in every module
    entries = [f"ignore:{prefix}:{cat.__name__}" for prefix, (cat, _) in KNOWN.items()]
    current = os.environ.get("PYTHONWARNINGS", "")
    os.environ["PYTHONWARNINGS"] = ",".join([e for e in current.split(",") if e and e not in entries] + entries)
