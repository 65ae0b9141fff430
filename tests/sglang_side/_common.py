"""Shared plumbing of the scripts in this folder. Imports only the standard library at module
level: the SGLang-side scripts import sglang through it lazily, the torch-only probes use it too.

* `quiet()`: silence SGLang's import-time warnings and logs so stdout carries JSON only.
* `route_call(endpoint, body, method, query)`: what SGLang 0.5.23's FastAPI app does with a request
  before its handler body runs: route lookup (404/405), FastAPI's own query and body validation
  against the route's declared parameter (`fastapi.dependencies.utils.request_body_to_args`, the
  function FastAPI's request handler calls), and SGLang's own `RequestValidationError` handler for
  the 400 answer. Returns the parsed request object and the keys of the body that SGLang drops.
* `tensor_summary(t)`: shape, dtype and float64 checksums of a tensor (both sides compare these).
"""

import asyncio
import dataclasses
import json
import logging
import os
import socket
import sys
import warnings
from typing import Any, Optional


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def default_sglang_python() -> str:
    venv = os.environ.get("SGLANG_VENV", os.path.join(ROOT, ".venv-sglang"))
    return os.path.join(venv, "bin", "python")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet():
    warnings.filterwarnings("ignore")
    logging.disable(logging.CRITICAL)


def read_json_input(argv):
    """JSON from argv[1] when given (a literal, or @path), else from stdin."""
    if len(argv) > 1:
        text = argv[1]
        if text.startswith("@"):
            with open(text[1:]) as f:
                text = f.read()
    else:
        text = sys.stdin.read()
    return json.loads(text)


def dump(obj):
    sys.stdout.write(json.dumps(obj, default=_json_default) + "\n")
    sys.stdout.flush()


def _json_default(obj):
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {"bytes_len": len(obj)}
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    return repr(obj)


def to_builtins(obj):
    from sglang.srt.utils.msgspec_utils import msgspec_to_builtins

    return msgspec_to_builtins(obj)


def tensor_summary(t) -> dict:
    import torch

    t64 = t.detach().to("cpu", torch.float64)
    return {
        "shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
        "sum": float(t64.sum()),
        "sumsq": float((t64 * t64).sum()),
    }


_APP = None


def sglang_app():
    """SGLang's own FastAPI app (`sglang.srt.entrypoints.http_server.app`); importing it starts nothing."""
    global _APP
    if _APP is None:
        from sglang.srt.entrypoints import http_server

        _APP = http_server.app
    return _APP


def _declared_fields(annotation) -> Optional[set]:
    """Field names of a route's body class (a msgspec Struct or a dataclass, maybe Optional[...])."""
    import typing

    import msgspec

    candidates = [annotation] + list(typing.get_args(annotation))
    for cls in candidates:
        if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
            return {f.name for f in msgspec.structs.fields(cls)}
        if isinstance(cls, type) and dataclasses.is_dataclass(cls):
            return {f.name for f in dataclasses.fields(cls)}
    return None


def _body_class_name(annotation) -> str:
    import typing

    for cls in [annotation] + list(typing.get_args(annotation)):
        if isinstance(cls, type) and cls is not type(None):
            return cls.__name__
    return repr(annotation)


@dataclasses.dataclass
class RouteResult:
    status: int  # what SGLang answers at this stage (200: passed to the handler)
    response: Any = None  # the JSON body SGLang answers with when status != 200
    obj: Any = None  # the parsed request object the handler receives
    request_class: Optional[str] = None
    ignored_keys: list = dataclasses.field(default_factory=list)


def _find_route(endpoint: str, method: str):
    from fastapi.routing import APIRoute

    routes = [r for r in sglang_app().routes if isinstance(r, APIRoute) and r.path == endpoint]
    for r in routes:
        if method in r.methods:
            return r, None
    if routes:
        return None, RouteResult(status=405, response={"detail": "Method Not Allowed"})
    return None, RouteResult(status=404, response={"detail": "Not Found"})


def route_call(endpoint: str, body: Any, method: str = "POST", query: Optional[dict] = None) -> RouteResult:
    return asyncio.run(_route_call(endpoint, body, method.upper(), query or {}))


async def _route_call(endpoint, body, method, query):
    from fastapi.dependencies.utils import request_body_to_args, request_params_to_args
    from fastapi.exceptions import RequestValidationError
    from starlette.requests import Request

    route, missing = _find_route(endpoint, method)
    if missing is not None:
        return missing
    dependant = route.dependant
    body_keys = sorted(body) if isinstance(body, dict) else []
    _, errors = request_params_to_args(dependant.query_params, query)
    obj, request_class, ignored = None, None, body_keys
    if dependant.body_params:
        field = dependant.body_params[0]
        annotation = field.field_info.annotation
        request_class = _body_class_name(annotation)
        values, body_errors = await request_body_to_args(
            dependant.body_params, body, route._embed_body_fields
        )
        errors = list(errors) + list(body_errors)
        obj = values.get(field.name)
        declared = _declared_fields(annotation)
        ignored = [k for k in body_keys if declared is not None and k not in declared]
    if errors:
        scope = {"type": "http", "method": method, "path": endpoint, "root_path": "",
                 "headers": [], "query_string": b""}
        handler = sglang_app().exception_handlers[RequestValidationError]
        resp = await handler(Request(scope), RequestValidationError(errors))
        return RouteResult(status=resp.status_code, response=json.loads(resp.body),
                           request_class=request_class, ignored_keys=ignored)
    return RouteResult(status=200, obj=obj, request_class=request_class, ignored_keys=ignored)


def error_response(exc: BaseException):
    """(status, body) the server answers when its handler raises `exc`: SGLang's
    `_create_error_response` for a ValueError; any other exception escapes the handler, and
    Starlette answers a plain-text 500."""
    if isinstance(exc, ValueError):
        return getattr(exc, "status_code", 400), {"error": {"message": str(exc)}}
    return 500, "Internal Server Error"
