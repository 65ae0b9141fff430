"""The embedded server's HTTP layer: SGLang's error answers, body validation, the request handler."""

from __future__ import annotations

import logging
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Dict

from megatron_rl.rollout.client import wire
from megatron_rl.rollout.embedded import http_body
from megatron_rl.rollout.embedded.decode_loop import EngineUnavailableError
from megatron_rl.rollout.embedded.scheduler_rules import SchedulerCrash

if TYPE_CHECKING:
    from megatron_rl.rollout.embedded.server import EmbeddedServer

log = logging.getLogger("megatron_rl.rollout.embedded.server")  # the server's log, as before the split


class HTTPError(Exception):
    """An answer other than 200: ``status`` and the JSON (or text) ``payload`` SGLang would send."""

    def __init__(self, status: int, payload: Any):
        super().__init__(wire.error_message(payload))
        self.status, self.payload = status, payload


def request_error(message: str, status: int = 400) -> HTTPError:
    return HTTPError(status, {"error": {"message": message}})


def weights_error(message: str) -> HTTPError:
    return HTTPError(400, {"success": False, "message": message})


def validation_error(field: str, message: str, value: Any = None) -> HTTPError:
    """What FastAPI answers when a body does not validate against the endpoint's request class."""
    return HTTPError(422, {"detail": [{"type": "value_error", "loc": ["body", field], "msg": message,
                                       "input": value}]})


def body_field(body: Dict[str, Any], key: str, kind, default=...):
    if key not in body or body[key] is None and default is not ...:
        if default is ...:
            raise validation_error(key, "Field required")
        return default
    value = body[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise validation_error(key, f"Input should be a valid {getattr(kind, '__name__', 'value')}", value)
    return value


class HTTPServer(ThreadingHTTPServer):
    # socketserver's default listen backlog is 5: a driver sending dozens of concurrent /generate requests
    # overflows it, and the dropped SYNs are retried only after ~1 s (100 small requests took 3.6 s, not 0.1 s).
    request_queue_size = 1024
    daemon_threads = True



def make_handler(server: "EmbeddedServer"):
    """The request handler class of ``server``: JSON in, ``server.dispatch(method, path, body)``, JSON out."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # keep test output quiet; debug logging only
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, status: int, payload: Any) -> None:
            if isinstance(payload, str):  # SGLang answers /flush_cache with text
                data, kind = payload.encode(), "text/plain; charset=utf-8"
            else:
                data, kind = (b"" if payload is None else http_body.dumps(payload)), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> Any:
            try:
                return http_body.parse_json(http_body.read_body(self.headers, self.rfile))
            except http_body.BodyError as e:
                self.close_connection = True  # where the next request starts is unknown
                raise HTTPError(e.status, e.payload) from None

        def _handle(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            try:
                status, payload = server.dispatch(method, path, self._body())
            except HTTPError as e:
                status, payload = e.status, e.payload
            except EngineUnavailableError as e:
                status, payload = 400, {"error": {"message": str(e)}}
            except SchedulerCrash as e:  # fatal on SGLang: answer, then go down (scheduler_rules.py)
                status, payload = 500, {"error": {"message": str(e)}}
                server.crash(str(e))
            except Exception as e:  # noqa: BLE001 - a bug must still answer, with its message
                log.exception("error serving %s %s", method, path)
                status, payload = 500, {"error": {"message": f"{type(e).__name__}: {e}"}}
            try:
                self._send(status, payload)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client went away (timeout, abort); nothing to answer

        def do_GET(self):
            self._handle("GET")

        def do_POST(self):
            self._handle("POST")

        def do_PUT(self):
            self._handle("PUT")

    return Handler
