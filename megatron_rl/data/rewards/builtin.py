"""Built-in reward functions. Each follows the reward protocol::

    fn(response_text: str, label: Any, **sample_info) -> float | list[float]

A list is a *per-token (process) reward*: one value per response token (``sample_info["response_ids"]``
holds the tokens), kept per token through advantages and loss (math_spec §i); its sum is the sequence's
reward in metrics, dynamic sampling and evaluation. A wrong answer is a reward of 0.0, not an error. Raising is for "this sample cannot be scored" (e.g. a
gold answer that does not parse): the runner then marks the sample failed with the reason.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from typing import Any

from megatron_rl.data.rewards.config import ExactMatchOptions

# Set by the reward worker process: there the runner's per-sample timeout (kill and replace the
# worker) is the one time limit, so math-verify's own SIGALRM timeouts — which turn a slow parse into a
# silent reward of 0 instead of a reported timeout — are switched off.
WORKER_ENV = "MEGATRON_RL_REWARD_WORKER"
_MATH_VERIFY_TIMEOUT_S = 5


def _signal_timeout_s() -> int | None:
    # math-verify implements its timeouts with signal.alarm, which Python allows only on the main thread.
    if os.environ.get(WORKER_ENV):
        # Deliberately off (see WORKER_ENV): keep math-verify from warning about it in every worker.
        logging.getLogger("math_verify").setLevel(logging.ERROR)
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    return _MATH_VERIFY_TIMEOUT_S


def math_reward(response_text: str, label: Any, **_: Any) -> float:
    """1.0 if the response's final answer equals ``label`` mathematically (math-verify), else 0.0.

    The response may carry its answer in ``\\boxed{...}``, ``$...$`` or as a plain number/expression;
    the label is parsed the same way (``"0.5"``, ``"1/2"``, ``"\\frac{1}{2}"`` are all the same gold).
    """
    from math_verify import parse, verify  # imported lazily: pulls in sympy (~0.5 s)

    if label is None:
        raise ValueError("math reward needs a label (data.label_field); got None")
    timeout = _signal_timeout_s()
    gold_text = str(label)
    gold = parse(gold_text, parsing_timeout=timeout)
    if not gold:  # bare LaTeX such as "\frac{1}{2}" extracts more reliably inside math delimiters
        gold = parse(f"${gold_text}$", parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math reward: math-verify could not parse the gold answer {gold_text[:200]!r}")
    answer = parse(response_text, parsing_timeout=timeout)
    if not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=timeout) else 0.0


def reward_value(value: Any) -> "float | tuple":
    """A reward function's return value as a float, or a tuple of floats (per-token rewards)."""
    if isinstance(value, (list, tuple)) or (hasattr(value, "tolist") and getattr(value, "ndim", 0) == 1):
        return tuple(float(v) for v in (value.tolist() if hasattr(value, "tolist") else value))
    return float(value)


_WHITESPACE = re.compile(r"\s+")


def normalize_text(text: str, options: ExactMatchOptions) -> str:
    if options.strip:
        text = text.strip()
    if options.collapse_whitespace:
        text = _WHITESPACE.sub(" ", text)
    if options.ignore_case:
        text = text.casefold()
    return text


def exact_match_reward(response_text: str, label: Any, options: ExactMatchOptions = ExactMatchOptions(),
                       **_: Any) -> float:
    """1.0 if the normalised response equals the normalised ``str(label)``, else 0.0."""
    if label is None:
        raise ValueError("exact_match reward needs a label (data.label_field); got None")
    return 1.0 if normalize_text(response_text, options) == normalize_text(str(label), options) else 0.0
