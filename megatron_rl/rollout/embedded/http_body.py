"""The embedded server's request bodies and JSON answers, hardened (issue 28): a body is read by its
``Content-Length`` or as ``Transfer-Encoding: chunked`` (never left on the connection to be read as a second
request), JSON nested deeper than :data:`MAX_JSON_DEPTH` is refused before anything else walks it, and answers
are strict JSON (a non-finite float is ``null``, as SGLang's orjson responses write it, never a bare ``NaN``).

A refusal here is a :class:`BodyError`; the handler answers it and closes the connection: after a malformed
body the server cannot know where the next request would start.
"""

from __future__ import annotations

import json
import math
from typing import Any, BinaryIO

MAX_BODY_BYTES = 4 << 30
MAX_JSON_DEPTH = 64  # a /generate body is 4 deep; orjson (SGLang's) stops at 1024, Python's json at ~1000
MAX_CHUNK_LINE = 1024  # a chunk-size line with extensions; longer is not a client of ours


class BodyError(Exception):
    """A body that cannot be read: the HTTP ``status`` and SGLang's ``{"detail": ...}`` payload; the connection
    must be closed after answering."""

    def __init__(self, status: int, detail: Any):
        super().__init__(str(detail))
        self.status, self.payload = status, {"detail": detail}


def read_body(headers, rfile: BinaryIO) -> bytes:
    """The request body's bytes: ``Content-Length`` or ``Transfer-Encoding: chunked`` (both at once, or any other
    transfer coding, is refused: RFC 9112 6.1 lets a server close such a request; that ambiguity is how requests
    are smuggled)."""
    codings = [c.strip().lower() for v in headers.get_all("Transfer-Encoding") or [] for c in v.split(",")
               if c.strip()]
    lengths = headers.get_all("Content-Length") or []
    if codings:
        if lengths:
            raise BodyError(400, "both Transfer-Encoding and Content-Length are set: send one of them")
        if codings != ["chunked"]:
            raise BodyError(400, f"Transfer-Encoding {', '.join(codings)!r} is not supported: send the body with a "
                                 "Content-Length, or Transfer-Encoding: chunked")
        return _read_chunked(rfile)
    if len(set(v.strip() for v in lengths)) > 1:
        raise BodyError(400, f"several different Content-Length headers: {lengths}")
    raw_length = lengths[0].strip() if lengths else "0"
    if not raw_length.isdigit():  # int() would take "+5", " 5", "5_0"
        raise BodyError(400, f"Invalid Content-Length header: {raw_length!r}")
    length = int(raw_length)
    if length > MAX_BODY_BYTES:
        raise BodyError(413, f"request body of {length} bytes exceeds {MAX_BODY_BYTES}")
    raw = rfile.read(length) if length else b""
    if len(raw) != length:
        raise BodyError(400, f"body shorter than its Content-Length ({len(raw)} < {length})")
    return raw


def _read_chunked(rfile: BinaryIO) -> bytes:
    parts, total = [], 0
    while True:
        line = rfile.readline(MAX_CHUNK_LINE + 1)
        if len(line) > MAX_CHUNK_LINE or not line.endswith(b"\n"):
            raise BodyError(400, "chunked body: a chunk-size line is missing, cut short or longer than "
                                 f"{MAX_CHUNK_LINE} bytes")
        size_text = line.split(b";", 1)[0].strip()
        if not size_text or any(c not in b"0123456789abcdefABCDEF" for c in size_text):
            raise BodyError(400, f"chunked body: chunk size {size_text[:40]!r} is not hexadecimal")
        size = int(size_text, 16)
        total += size
        if total > MAX_BODY_BYTES:
            raise BodyError(413, f"chunked request body exceeds {MAX_BODY_BYTES} bytes")
        if size == 0:
            break
        data = rfile.read(size)
        if len(data) != size or rfile.read(2) != b"\r\n":
            raise BodyError(400, f"chunked body: a chunk is shorter than its size {size} or not followed by CRLF")
        parts.append(data)
    for _ in range(64):  # trailer fields, up to the empty line that ends the body
        line = rfile.readline(MAX_CHUNK_LINE + 1)
        if line in (b"\r\n", b"\n"):
            return b"".join(parts)
        if not line.endswith(b"\n"):
            break
    raise BodyError(400, "chunked body: the trailer section does not end with an empty line")


def parse_json(raw: bytes) -> Any:
    """The body as JSON (``{}`` when empty); FastAPI's 422 ``json_invalid`` for what does not parse, 400 for
    nesting deeper than :data:`MAX_JSON_DEPTH` (Python's parser stops at ~1000 with a RecursionError, which is
    caught; what it parses is walked without recursion, so nothing downstream recurses into it)."""
    if not raw.strip():
        return {}
    too_deep = BodyError(400, f"JSON body nested deeper than {MAX_JSON_DEPTH} levels: refused")
    try:
        value = json.loads(raw)
    except RecursionError:
        raise too_deep from None
    except ValueError as e:
        pos = getattr(e, "pos", 0)
        raise BodyError(422, [{"type": "json_invalid", "loc": ["body", pos], "msg": f"JSON decode error: {e}"}]) \
            from None
    if exceeds_depth(value, MAX_JSON_DEPTH):
        raise too_deep
    return value


def exceeds_depth(value: Any, limit: int) -> bool:
    """Whether lists / objects nest deeper than ``limit`` (iterative: a walk over the containers' items)."""
    stack = [(value, 1)] if isinstance(value, (list, dict)) else []
    while stack:
        x, depth = stack.pop()
        if depth > limit:
            return True
        for v in (x.values() if isinstance(x, dict) else x):
            if isinstance(v, (list, dict)):
                stack.append((v, depth + 1))
    return False


def dumps(payload: Any) -> bytes:
    """Strict JSON: a non-finite float becomes ``null`` (orjson's rule, SGLang's responses), never ``NaN``."""
    try:
        return json.dumps(payload, allow_nan=False).encode()
    except ValueError:  # rare: only answers that carry a non-finite number pay for the walk
        return json.dumps(_finite(payload), allow_nan=False).encode()


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
