"""An HTTP server speaking SGLang's native endpoints over an ``EmbeddedEngine`` (stdlib only).

Same paths and JSON fields as SGLang 0.5.x (see ``wire.py``), so the HTTP client, the balancer and the
driver are exercised identically on CPU and against real SGLang. Binds 127.0.0.1 by default.

Concurrency: each connection gets a thread (``ThreadingHTTPServer``); ``/generate`` jobs go through one
queue whose worker batches everything waiting into one engine call (seeded sampling does not depend on
batch composition, so batching changes no token; log-probs may move by float rounding, ~1e-6), after a
short gathering pause (10 ms without a new request, 100 ms at most) so that a driver's concurrent
requests share one batch. There is no continuous batching: a request arriving while a batch runs waits
for it. Control endpoints (abort, pause) act between decode steps; weight updates wait for the running
batch to finish.

Differences from SGLang, all answered with a clear status: no tokenizer (``text`` input -> 400,
``text`` output is ""), no streaming, prompt log-probs (``logprob_start_len >= 0``) come without
``input_top_logprobs`` and cost one extra forward of the prompt, ``/update_weights_from_tensor`` takes
safetensors (``wire.py``), ``pause_generation`` mode ``retract`` behaves like ``in_place``.

Run: ``python -m megatron_rl.rollout.server --model-path DIR [--port N] [--logprob-mode raw]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
import uuid
from collections import deque
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron_rl.rollout import weight_group, wire
from megatron_rl.rollout.embedded import EmbeddedEngine, EmbeddedEngineConfig, EngineUnavailableError
from megatron_rl.rollout.hf_weights import WeightUpdateError
from megatron_rl.rollout.protocol import GenerateRequest, Sample

log = logging.getLogger(__name__)


class HTTPError(Exception):
    def __init__(self, status: int, message: str, field: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.field = status, message, field


class _Job:
    def __init__(self, requests: List[GenerateRequest]):
        self.requests = requests
        self.done = threading.Event()
        self.samples: Optional[List[Sample]] = None
        self.error: Optional[BaseException] = None


class GenerationQueue:
    """Batches queued ``/generate`` jobs into engine calls on one worker thread.

    A driver sends a step's prompts as concurrent requests, which reach the queue a few milliseconds
    apart; started on the first arrival, the batch would hold one request and the rest would wait for it
    (two batches, twice the decode steps). So the worker gathers first: once a job is waiting, it starts
    when no new job has come for ``gather_quiet_s``, or ``gather_max_s`` after the first (0 disables).
    """

    def __init__(self, engine: EmbeddedEngine, gather_quiet_s: float = 0.01, gather_max_s: float = 0.1):
        self.engine = engine
        self.gather_quiet_s, self.gather_max_s = gather_quiet_s, gather_max_s
        self._jobs: deque = deque()
        self._cv = threading.Condition()
        self._paused = False
        self._stopped = False
        self._thread = threading.Thread(target=self._work, name="generation-queue", daemon=True)
        self._thread.start()

    def submit(self, requests: List[GenerateRequest]) -> List[Sample]:
        job = _Job(requests)
        with self._cv:
            self._jobs.append(job)
            self._cv.notify_all()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.samples

    def pause(self) -> None:
        with self._cv:
            self._paused = True

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def abort_queued(self, rid: Optional[str], abort_all: bool) -> None:
        with self._cv:
            keep = deque()
            for job in self._jobs:
                if abort_all or any(r.rid == rid for r in job.requests):
                    job.samples = [_aborted(self.engine, r, j) for r in job.requests for j in range(r.sampling.n)]
                    job.done.set()
                else:
                    keep.append(job)
            self._jobs = keep

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self.abort_queued(None, abort_all=True)

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and (self._paused or not self._jobs):
                    self._cv.wait()
                if self._stopped:
                    return
                self._gather()
                if self._stopped:
                    return
                if self._paused or not self._jobs:  # paused, or the gathered jobs were aborted meanwhile
                    continue
                jobs = list(self._jobs)
                self._jobs.clear()
            try:
                samples = self.engine.generate([r for job in jobs for r in job.requests])
            except BaseException as e:  # noqa: BLE001 - reported to every waiting handler
                for job in jobs:
                    job.error = e
                    job.done.set()
                continue
            for job in jobs:
                count = sum(r.sampling.n for r in job.requests)
                job.samples, samples = samples[:count], samples[count:]
                job.done.set()

    def _gather(self) -> None:
        """Wait (holding ``_cv``'s lock between waits) until arrivals pause; see the class doc."""
        if self.gather_max_s <= 0:
            return
        deadline = time.monotonic() + self.gather_max_s
        seen = len(self._jobs)
        while not self._stopped and not self._paused:
            remaining = min(self.gather_quiet_s, deadline - time.monotonic())
            if remaining <= 0:
                return
            self._cv.wait(remaining)
            if len(self._jobs) <= seen:  # nothing new for gather_quiet_s (or jobs were aborted)
                return
            seen = len(self._jobs)


def _aborted(engine: EmbeddedEngine, req: GenerateRequest, index: int) -> Sample:
    return Sample(prompt_ids=list(req.prompt_ids), response_ids=[], logprobs=[], finish_reason="abort",
                  weight_version=engine.weight_version, logprob_mode=engine.config.logprob_mode, rid=req.rid,
                  sample_index=index)


def _field(body: Dict[str, Any], key: str, kind, default=...):
    if key not in body:
        if default is ...:
            raise HTTPError(400, "required field is missing", key)
        return default
    value = body[key]
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        raise HTTPError(400, f"expected {getattr(kind, '__name__', kind)}, got {type(value).__name__}", key)
    return value


class _HTTPServer(ThreadingHTTPServer):
    # socketserver's default listen backlog is 5: a driver sending dozens of concurrent /generate requests
    # overflows it, and the dropped SYNs are retried only after ~1 s (100 small requests took 3.6 s, not 0.1 s).
    request_queue_size = 1024
    daemon_threads = True


class EmbeddedServer:
    """``EmbeddedServer(engine).start()``; ``.url``; ``.stop()``."""

    def __init__(self, engine: EmbeddedEngine, host: str = "127.0.0.1", port: int = 0):
        self.engine = engine
        self.queue = GenerationQueue(engine)
        self._groups: Dict[str, Any] = {}
        self._routes: Dict[Tuple[str, str], Callable[[Dict[str, Any]], Any]] = {}
        for path, handler, methods in [
            ("/health", self._health, ("GET", "POST")), ("/get_server_info", self._server_info, ("GET",)),
            ("/get_weight_version", self._weight_version, ("GET",)), ("/generate", self._generate, ("POST",)),
            ("/update_weights_from_tensor", self._update_from_tensor, ("POST",)),
            ("/init_weights_update_group", self._init_group, ("POST",)),
            ("/update_weights_from_distributed", self._update_from_distributed, ("POST",)),
            ("/destroy_weights_update_group", self._destroy_group, ("POST",)),
            ("/flush_cache", self._flush_cache, ("GET", "POST")),
            ("/release_memory_occupation", self._release, ("POST",)),
            ("/resume_memory_occupation", self._resume, ("POST",)),
            ("/pause_generation", self._pause, ("POST",)), ("/continue_generation", self._continue, ("POST",)),
            ("/abort_request", self._abort, ("POST",)), ("/update_weight_version", self._set_version, ("POST",)),
        ]:
            for method in methods:
                self._routes[(method, path)] = handler
        self.httpd = _HTTPServer((host, port), _make_handler(self))
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "EmbeddedServer":
        # a short poll interval makes stop() return quickly (shutdown waits for the next poll)
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), name="embedded-server",
                                        daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def stop(self) -> None:
        self.queue.stop()
        self.httpd.shutdown()
        self.httpd.server_close()

    def dispatch(self, method: str, path: str, body: Any) -> Tuple[int, Any]:
        handler = self._routes.get((method, path))
        if handler is None:
            if any(p == path for _, p in self._routes):
                raise HTTPError(405, f"{method} is not allowed on {path}")
            raise HTTPError(404, f"no endpoint {path}")
        if not isinstance(body, dict):
            raise HTTPError(400, "expected a JSON object", "body")
        return handler(body)

    # ---- endpoints ---------------------------------------------------------------------------------

    def _health(self, body):
        h = self.engine.health()
        status = 200 if h.healthy else 503
        return status, dict(status="ok" if h.healthy else "unhealthy", weight_version=h.weight_version,
                            memory_released=h.memory_released, paused=h.paused, detail=h.detail)

    def _server_info(self, body):
        r = self.engine.routing
        return 200, dict(engine="embedded", logprob_mode=self.engine.config.logprob_mode,
                         weight_version=self.engine.weight_version, moe_layers=r.num_layers, moe_topk=r.top_k,
                         max_context=self.engine.max_context)

    def _weight_version(self, body):
        return 200, {"weight_version": self.engine.weight_version}

    def _generate(self, body):
        try:
            requests, batch, options = wire.parse_generate(body)
        except wire.BadRequest as e:
            raise HTTPError(400, e.message, e.field) from None
        named = []
        for i, r in enumerate(requests):
            try:
                self.engine.check_request(r)
            except ValueError as e:
                raise HTTPError(400, str(e), "input_ids" if not batch else f"input_ids[{i}]") from None
            named.append(r if r.rid else GenerateRequest(r.prompt_ids, r.sampling, r.return_top_logprobs,
                                                         r.return_routed_experts, uuid.uuid4().hex))
        samples = self.queue.submit(named)
        start = options["logprob_start_len"]
        items, k = [], 0
        for r in named:
            prompt_lp = None
            if options["return_logprob"] and start >= 0:
                # after generation, so both come from the weights the samples report
                scores = self.engine.prompt_logprobs(r.prompt_ids)[0]
                prompt_lp = wire.input_logprob_entries(r.prompt_ids, scores, start)
            for _ in range(r.sampling.n):
                items.append(wire.sample_to_json(samples[k], options, r.sampling.max_new_tokens, prompt_lp))
                k += 1
        return 200, (items if batch or len(items) > 1 else items[0])

    def _apply(self, buckets, body) -> Tuple[int, Any]:
        version = _field(body, "weight_version", (str, int, type(None)), None)
        try:
            self.engine.update_weights(buckets, version if version is not None else self.engine.weight_version)
        except WeightUpdateError as e:
            return 400, {"success": False, "message": str(e)}
        return 200, {"success": True, "message": f"updated; weight_version={self.engine.weight_version}"}

    def _update_from_tensor(self, body):
        fmt = _field(body, "load_format", (str, type(None)), None)
        payloads = _field(body, "serialized_named_tensors", list)
        if fmt not in ("safetensors", "safetensors_file"):
            raise HTTPError(400, f"load_format={fmt!r} is not supported by the embedded server: send "
                            "'safetensors' (base64 safetensors bytes) or 'safetensors_file' (server-readable "
                            "paths); SGLang's pickled MultiprocessingSerializer format is not accepted",
                            "load_format")
        if not all(isinstance(p, str) for p in payloads):
            raise HTTPError(400, "expected a list of strings", "serialized_named_tensors")
        if body.get("abort_all_requests"):
            self.engine.abort(abort_all=True)
            self.queue.abort_queued(None, abort_all=True)
        try:
            if fmt == "safetensors":
                buckets = [wire.decode_bucket(p) for p in payloads]
            else:
                from safetensors.torch import load_file

                buckets = [list(load_file(p).items()) for p in payloads]
        except Exception as e:  # noqa: BLE001 - any decode failure is the client's payload
            raise HTTPError(400, f"cannot decode the tensors: {type(e).__name__}: {e}",
                            "serialized_named_tensors") from None
        return self._apply(buckets, body)

    def _init_group(self, body):
        name = _field(body, "group_name", str, "weight_update_group")
        try:
            group = weight_group.create_weight_group(
                _field(body, "master_address", str), _field(body, "master_port", int),
                _field(body, "rank_offset", int), _field(body, "world_size", int),
                backend=_field(body, "backend", str, "gloo"), group_name=name,
                timeout_s=float(_field(body, "timeout_s", (int, float), 300)))
        except HTTPError:
            raise
        except Exception as e:  # noqa: BLE001
            return 400, {"success": False, "message": f"cannot join weight group {name!r}: {e}"}
        self._groups[name] = group
        return 200, {"success": True, "message": f"joined weight group {name!r}"}

    def _update_from_distributed(self, body):
        name = _field(body, "group_name", str, "weight_update_group")
        if name not in self._groups:
            raise HTTPError(400, f"no weight group {name!r}; call /init_weights_update_group first", "group_name")
        names, dtypes, shapes = (_field(body, k, list) for k in ("names", "dtypes", "shapes"))
        try:
            bucket = weight_group.receive_bucket(self._groups[name], names, dtypes, shapes)
        except ValueError as e:
            raise HTTPError(400, str(e), "names") from None
        return self._apply([bucket], body)

    def _destroy_group(self, body):
        self._groups.pop(_field(body, "group_name", str, "weight_update_group"), None)
        return 200, {"success": True, "message": "destroyed"}

    def _flush_cache(self, body):
        return 200, {"success": True, "message": "nothing cached across requests"}

    def _release(self, body):
        self.engine.release_memory()
        return 200, {"success": True, "message": "released"}

    def _resume(self, body):
        self.engine.resume_memory()
        return 200, {"success": True, "message": "resumed"}

    def _pause(self, body):
        mode = _field(body, "mode", str, "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise HTTPError(400, f"mode={mode!r}: expected 'abort', 'retract' or 'in_place'", "mode")
        self.queue.pause()
        self.engine.pause()
        if mode == "abort":
            self.engine.abort(abort_all=True)
            self.queue.abort_queued(None, abort_all=True)
        return 200, {"success": True, "message": f"paused ({mode})"}

    def _continue(self, body):
        self.engine.continue_generation()
        self.queue.resume()
        return 200, {"success": True, "message": "continued"}

    def _abort(self, body):
        rid = _field(body, "rid", (str, type(None)), None)
        abort_all = _field(body, "abort_all", bool, False)
        if rid is None and not abort_all:
            raise HTTPError(400, "give a rid or abort_all=true", "rid")
        self.engine.abort(rid, abort_all)
        self.queue.abort_queued(rid, abort_all)
        return 200, {"success": True, "message": "aborted"}

    def _set_version(self, body):
        version = _field(body, "new_version", (str, int))
        if body.get("abort_all_requests"):
            self.engine.abort(abort_all=True)
        self.engine.update_weight_version(version)
        return 200, {"success": True, "message": f"weight_version={self.engine.weight_version}"}


def _make_handler(server: EmbeddedServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # keep test output quiet; debug logging only
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _handle(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            try:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw.strip() else {}
                except ValueError as e:
                    raise HTTPError(400, f"body is not valid JSON: {e}", "body") from None
                status, payload = server.dispatch(method, path, body)
            except HTTPError as e:
                status, payload = e.status, dict(object="error", message=e.message, type=HTTPStatus(e.status).phrase,
                                                 param=e.field, code=e.status)
            except EngineUnavailableError as e:
                status, payload = 409, dict(object="error", message=str(e), type="Conflict", param=None, code=409)
            except Exception as e:  # noqa: BLE001 - a bug must still answer, with its message
                log.exception("error serving %s %s", method, path)
                status, payload = 500, dict(object="error", message=f"{type(e).__name__}: {e}",
                                            type="InternalServerError", param=None, code=500)
            try:
                self._send(status, payload)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client went away (timeout, abort); nothing to answer

        def do_GET(self):
            self._handle("GET")

        def do_POST(self):
            self._handle("POST")

    return Handler


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description="SGLang-compatible HTTP server over an embedded transformers engine")
    p.add_argument("--model-path", required=True, help="HF model directory (config.json + weights)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed on start)")
    p.add_argument("--logprob-mode", default="raw", choices=["raw", "processed"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch-rows", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    engine = EmbeddedEngine.from_pretrained(
        args.model_path, EmbeddedEngineConfig(logprob_mode=args.logprob_mode, seed=args.seed,
                                              max_batch_rows=args.max_batch_rows),
        dtype=weight_group.dtype_from_name(args.dtype))
    torch.set_grad_enabled(False)
    server = EmbeddedServer(engine, args.host, args.port)
    print(f"embedded server listening on {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
