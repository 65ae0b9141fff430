"""A synthetic, verifiable task for the tiny CPU recipe: single-digit arithmetic.

Rows look like ``{"prompt": "3+4=", "answer": "7"}``. The defaults (``a+b`` with ``0 <= a, b <= 9``,
answers ``0..18``) are chosen so a ~1M-parameter model learns visibly within minutes on a CPU: 100
distinct problems, 1-2 answer tokens plus ``<eos>`` with the tiny character tokenizer, and a reward
that is exactly checkable. Use ``RewardConfig(kind="exact_match")`` (default options strip whitespace):
the response ``"7"`` scores 1, ``"7+1"`` or ``"8"`` score 0 — which also teaches the model to stop.

Everything is a pure function of the seed (Python's ``random.Random``), so the recipe regenerates the
same file on every machine instead of downloading one.
"""

from __future__ import annotations

import json
import os
import random
from typing import Dict, Iterable, List, Sequence

OPERATORS = ("+", "-", "*")


def solve(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"operator {op!r}: expected one of {OPERATORS}")


def make_problem(a: int, op: str, b: int) -> Dict[str, str]:
    """One row: ``{"prompt": "a<op>b=", "answer": "<result>"}``."""
    return {"prompt": f"{a}{op}{b}=", "answer": str(solve(a, op, b))}


def _check(max_operand: int, operators: Sequence[str]) -> None:
    if isinstance(max_operand, bool) or not isinstance(max_operand, int) or max_operand < 0:
        raise ValueError(f"max_operand={max_operand!r}: expected an integer >= 0")
    bad = [op for op in operators if op not in OPERATORS]
    if not operators or bad:
        raise ValueError(f"operators={tuple(operators)!r}: expected a non-empty subset of {OPERATORS}")


def generate_problems(num_problems: int, seed: int = 0, max_operand: int = 9,
                      operators: Sequence[str] = ("+",)) -> List[Dict[str, str]]:
    """``num_problems`` rows drawn uniformly (with replacement) from ``a op b``, ``0 <= a, b <= max_operand``."""
    _check(max_operand, operators)
    if isinstance(num_problems, bool) or not isinstance(num_problems, int) or num_problems < 1:
        raise ValueError(f"num_problems={num_problems!r}: expected an integer >= 1")
    rng = random.Random(seed)
    ops = list(operators)
    return [make_problem(rng.randint(0, max_operand), rng.choice(ops), rng.randint(0, max_operand))
            for _ in range(num_problems)]


def all_problems(max_operand: int = 9, operators: Sequence[str] = ("+",)) -> List[Dict[str, str]]:
    """Every distinct problem once, in a fixed order (an exhaustive evaluation set)."""
    _check(max_operand, operators)
    return [make_problem(a, op, b) for op in operators
            for a in range(max_operand + 1) for b in range(max_operand + 1)]


def write_jsonl(path: str | os.PathLike, rows: Iterable[Dict[str, str]]) -> str:
    """Write ``rows`` one JSON object per line (parent directories created); returns the path."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def write_arithmetic_dataset(path: str | os.PathLike, num_problems: int = 1024, seed: int = 0,
                             max_operand: int = 9, operators: Sequence[str] = ("+",)) -> str:
    """Generate and write the tiny recipe's prompt file (fields ``prompt`` and ``answer``)."""
    return write_jsonl(path, generate_problems(num_problems, seed, max_operand, operators))
