"""``/generate`` sampling parameters checked and normalised per request, as SGLang 0.5.23 does, before any of
them can reach the shared decode batch (one client's bad field must not fail the others' requests).

SGLang's order, each stage answering 400 (``srt/entrypoints/api_contract.py``, ``srt/sampling/sampling_params.py``):

1. the JSON contract: each key's JSON type (``{"error": "<field>: invalid type: ..."}``, the contract shape);
2. ``SamplingParams.__post_init__``: ``0 <= temperature < 1e-6`` is greedy (top_k then ignored), ``top_k = -1``
   is the whole vocabulary;
3. ``SamplingParams.verify(vocab_size)`` and ``normalize``: ranges (``{"error": {"message": ...}}``, SGLang's
   message prefixed with the field).

Then what the engine needs that SGLang gets elsewhere: a ``top_k`` above ``2**30`` (SGLang's "whole vocabulary")
is clipped to it (it must fit the batch's int64 tensor: ``10**20`` made every request of the batch fail), stop ids
outside ``[0, vocab_size)`` are dropped (they can never match; SGLang keeps them in a set). What the embedded
engine does not implement (penalties, grammars, stop strings) is then refused by ``wire.parse_sampling_params``.
"""

from __future__ import annotations

import math
from typing import Any, Dict

from megatron_rl.rollout.client.wire import BadRequest

SAMPLING_EPS = 1e-6  # SGLang's _SAMPLING_EPS: a temperature below it is greedy
TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary"
MAX_STOP_COUNT = 32

_INT = ("max_new_tokens", "top_k", "min_new_tokens", "n", "sampling_seed", "beam_width", "stream_interval")
_FLOAT = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_BOOL = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
_STR = ("regex", "json_schema", "ebnf", "structural_tag")
_GRAMMARS = ("json_schema", "regex", "ebnf", "structural_tag")


def normalize_generate_body(body: Any, vocab_size: int) -> Any:
    """``body`` with each ``sampling_params`` object checked and normalised (a shallow copy; ``body`` is left
    as it is). Raises :class:`~megatron_rl.rollout.client.wire.BadRequest` naming the field."""
    if not isinstance(body, dict) or "sampling_params" not in body:
        return body
    sp = body["sampling_params"]
    if isinstance(sp, list):
        sp = [normalize_sampling_params(s, f"sampling_params[{i}]", vocab_size) for i, s in enumerate(sp)]
    elif sp is not None:
        sp = normalize_sampling_params(sp, "sampling_params", vocab_size)
    return {**body, "sampling_params": sp}


def normalize_sampling_params(obj: Any, where: str, vocab_size: int) -> Any:
    """One ``sampling_params`` object through SGLang's three stages (module doc); a new dict."""
    if not isinstance(obj, dict):
        return obj  # wire.parse_sampling_params refuses it with SGLang's contract answer
    _check_types(obj, where)
    sp = {k: v for k, v in obj.items() if v is not None}  # null is the default (SGLang's __post_init__)
    temperature = sp.get("temperature", 1.0)
    if 0 <= temperature < SAMPLING_EPS:  # greedy: SGLang's (temperature 1, top_k 1); ours is temperature 0
        sp["temperature"] = 0.0
        sp.pop("top_k", None)
    _verify(sp, where, vocab_size)
    if sp.get("top_k", -1) > TOP_K_ALL:
        sp["top_k"] = TOP_K_ALL
    if "stop_token_ids" in sp:
        sp["stop_token_ids"] = [t for t in sp["stop_token_ids"] if 0 <= t < vocab_size]
    return sp


def _check_types(obj: Dict[str, Any], where: str) -> None:
    for key, value in obj.items():
        if value is None:
            continue
        if key in _INT and (isinstance(value, bool) or not isinstance(value, int)):
            raise _contract(where, key, value, "i64")
        if key in _FLOAT and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise _contract(where, key, value, "f64")
        if key in _BOOL and not isinstance(value, bool):
            raise _contract(where, key, value, "a boolean")
        if key in _STR and not isinstance(value, str):
            raise _contract(where, key, value, "a string")
        if key == "stop_token_ids":
            if not isinstance(value, list):
                raise _contract(where, key, value, "a sequence")
            bad = next((t for t in value if isinstance(t, bool) or not isinstance(t, int)), None)
            if bad is not None:
                raise _contract(where, key, bad, "i64")
        if key in ("stop", "stop_regex") and not (isinstance(value, str) or isinstance(value, list)
                                                  and all(isinstance(s, str) for s in value)):
            raise _contract(where, key, value, "a string or a sequence of strings")
        if key == "logit_bias" and not isinstance(value, dict):
            raise _contract(where, key, value, "a map")


def _verify(sp: Dict[str, Any], where: str, vocab_size: int) -> None:
    """``SamplingParams.verify`` (and ``normalize``'s stop count), SGLang's messages."""
    def bad(key: str, message: str) -> BadRequest:
        return BadRequest(f"{where}.{key}", message)

    get = sp.get
    if get("beam_width") is not None and get("beam_width") < 1:
        raise bad("beam_width", f"beam_width must be at least 1, got {get('beam_width')}.")
    t = get("temperature", 1.0)
    if not math.isfinite(t) or t < 0.0:
        raise bad("temperature", f"temperature must be a non-negative finite number, got {t}.")
    if not 0.0 < get("top_p", 1.0) <= 1.0:
        raise bad("top_p", f"top_p must be in (0, 1], got {get('top_p')}.")
    if not 0.0 <= get("min_p", 0.0) <= 1.0:
        raise bad("min_p", f"min_p must be in [0, 1], got {get('min_p')}.")
    k = get("top_k", -1)
    if k != -1 and k < 1:
        raise bad("top_k", f"top_k must be -1 (disable) or at least 1, got {k}.")
    for key in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= get(key, 0.0) <= 2.0:
            raise bad(key, f"{key} must be in [-2, 2], got {get(key)}.")
    if not 0.0 < get("repetition_penalty", 1.0) <= 2.0:
        raise bad("repetition_penalty", "repetition_penalty must be in (0, 2] (1.0 = no penalty), got "
                                        f"{get('repetition_penalty')}.")
    low, high = get("min_new_tokens", 0), get("max_new_tokens", 128)
    if low < 0:
        raise bad("min_new_tokens", f"min_new_tokens must be in [0, max_new_tokens], got {low}.")
    if high < 0:
        raise bad("max_new_tokens", f"max_new_tokens must be at least 0, got {high}.")
    if low > high:
        raise bad("min_new_tokens", f"min_new_tokens must be in [0, max_new_tokens({high})], got {low}.")
    for token in get("logit_bias") or {}:
        try:
            ok = 0 <= int(token) < vocab_size
        except ValueError:
            ok = False
        if not ok:
            raise bad("logit_bias", f"logit_bias must has keys in [0, {vocab_size - 1}], got {token}.")
    seed = get("sampling_seed")
    if seed is not None and not -(2 ** 63) <= seed <= 2 ** 63 - 1:
        raise bad("sampling_seed", f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
    if sum(get(g) not in (None, "") for g in _GRAMMARS) > 1:
        raise bad("regex", "Only one of json_schema, regex, ebnf, or structural_tag can be set.")
    stops = get("stop")
    if isinstance(stops, list) and len(stops) > MAX_STOP_COUNT:
        raise bad("stop", f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(stops)}")


def _contract(where: str, key: str, value: Any, expected: str) -> BadRequest:
    """SGLang's JSON-contract refusal (``{"error": "..."}``), the field named."""
    kind = {bool: "boolean", int: "integer", float: "floating point", str: "string", list: "sequence",
            dict: "map"}.get(type(value), type(value).__name__)
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return BadRequest(f"{where}.{key}", f"invalid type: {kind} `{shown}`, expected {expected}", contract=True)
