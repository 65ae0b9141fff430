"""Which weight version produced each response token, as SGLang 0.5.23 reports it.

SGLang (``srt/utils/weight_versions.py``, ported here): when the served weight version changes
(``/update_weight_version``, or a weight update that names ``weight_version``), every live request that
already has output tokens records a :class:`WeightVersionEvent` ``(old_version, tokens so far)``. A finished
(or aborted) request's events become contiguous :class:`WeightVersionSpan` s over its output tokens, sent as
``meta_info["weight_versions"] = [{"version", "start", "end"}, ...]`` beside ``meta_info["weight_version"]``
(the last span's version). Tokens ``[start, end)`` were sampled from logits computed under ``version``: a
request paused in place across an update (partial rollouts) spans two versions.

The version strings are the driver's: the trainer publishes the weights after step ``s`` as ``"s"``;
engines started from the initial checkpoint report ``"default"`` (version 0 here, :func:`version_number`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence


@dataclass(frozen=True)
class WeightVersionEvent:
    old_version: str
    num_output_tokens: int


@dataclass
class WeightVersionSpan:
    version: str
    start: int
    end: int


def record_event(events: List[WeightVersionEvent], old_version: str, num_output_tokens: int) -> None:
    """SGLang's ``record_weight_version_events`` for one request: only a request with output records."""
    if num_output_tokens:
        events.append(WeightVersionEvent(old_version, num_output_tokens))


def compute_spans(events: Sequence[WeightVersionEvent], current_version: str,
                  num_output_tokens: int) -> List[WeightVersionSpan]:
    """SGLang's ``compute_weight_version_spans`` (same merging of repeated versions and empty spans)."""
    changes = [(e.old_version, e.num_output_tokens) for e in events] + [(current_version, num_output_tokens)]
    spans: List[WeightVersionSpan] = []
    for version, end in changes:
        end = min(end, num_output_tokens)
        if spans and end <= spans[-1].end:
            continue
        if spans and version == spans[-1].version:
            spans[-1].end = end
            continue
        spans.append(WeightVersionSpan(version, spans[-1].end if spans else 0, end))
    return spans


def spans_to_meta(spans: Sequence[WeightVersionSpan], num_output_tokens: int) -> Dict[str, Any]:
    """SGLang's ``add_weight_versions_to_meta_info``: the visible spans and the last one's version."""
    visible = [s for s in spans if s.start < num_output_tokens or s.start == 0]
    return {"weight_versions": [{"version": s.version, "start": s.start, "end": min(s.end, num_output_tokens)}
                                for s in visible],
            "weight_version": visible[-1].version}


def spans_from_meta(entries: Any, num_output_tokens: int) -> List[WeightVersionSpan]:
    """``meta_info["weight_versions"]`` -> spans, checked to tile ``[0, num_output_tokens)`` in order."""
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"meta_info.weight_versions={entries!r}: expected a non-empty list of "
                         "{version, start, end} spans")
    spans = [WeightVersionSpan(str(e["version"]), int(e["start"]), int(e["end"])) for e in entries]
    position = 0
    for s in spans:
        if s.start != position or s.end < s.start:
            raise ValueError(f"meta_info.weight_versions={entries!r} do not tile the {num_output_tokens} output "
                             "tokens in order")
        position = s.end
    if position != num_output_tokens:
        raise ValueError(f"meta_info.weight_versions={entries!r} cover {position} of {num_output_tokens} output tokens")
    return spans


def version_number(version: str) -> int:
    """The integer policy version of a version string: ``"s"`` -> ``s``. The run publishes only step numbers, so
    any other label (SGLang's start-up ``"default"``, or one the server was launched with) names the weights the
    engines started from -- the initial checkpoint the step-0 check compared with the trainer's: 0."""
    try:
        return int(version)
    except ValueError:
        return 0


def token_versions(spans: Optional[Sequence[WeightVersionSpan]], fallback: str, num_tokens: int) -> List[int]:
    """Per-token integer versions from ``spans`` (``fallback`` for every token when the engine sent none)."""
    if spans is None:
        return [version_number(fallback)] * num_tokens
    out: List[int] = []
    for s in spans:
        out += [version_number(s.version)] * (s.end - s.start)
    if len(out) != num_tokens:
        raise ValueError(f"weight-version spans cover {len(out)} tokens, the response has {num_tokens}")
    return out
