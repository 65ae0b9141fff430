"""The built-in rewards compare ``str(label)`` with the response: a label that is a list, a mapping or another
non-scalar (``["2"]`` -> ``"['2']"``) never matches, and every reward is silently 0. Said once per run and type,
loudly, by the driver's reward runner (it sees every label before the workers do)."""

from __future__ import annotations

import logging
import numbers
import warnings
from typing import Any, Sequence, Set

logger = logging.getLogger(__name__)
_COMPARED = ("exact_match", "math")  # the kinds that compare str(label); a custom fn takes what it is given


class LabelTypeWatch:
    """Warns once per label type a built-in reward cannot compare."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._said: Set[str] = set()

    def check(self, labels: Sequence[Any]) -> None:
        if self.kind not in _COMPARED:
            return
        for label in labels:
            if label is None or isinstance(label, (str, numbers.Number)) and not isinstance(label, bool):
                continue
            name = type(label).__name__
            if name in self._said:
                continue
            self._said.add(name)
            n = sum(type(x).__name__ == name for x in labels)
            message = (f"REWARD CANNOT COMPARE LABELS: reward.kind={self.kind!r} compares the response with "
                       f"str(label), but {n} of this batch's {len(labels)} labels are a {name} (e.g. "
                       f"{str(label)[:60]!r}): they never match and score 0. Store the gold answer as a string or "
                       "number in data.label_field, or use reward.kind=custom with a function that reads it")
            logger.warning("\n%s\n%s\n%s", "!" * 100, message, "!" * 100)
            warnings.warn(message, UserWarning, stacklevel=3)
