"""An HTTP server that behaves as SGLang 0.5.23 does, over an ``EmbeddedEngine`` (stdlib only).

A test double written from SGLang's released source (``srt/entrypoints/http_server.py``,
``srt/managers/scheduler_components/weight_updater.py``, ``tokenizer_manager.py``, ``io_struct.py``), so
the HTTP client, the balancer, the weight sync and the driver meet SGLang's rules on CPU:

* weight updates (``/update_weights_from_distributed``, ``/update_weights_from_tensor``) only between
  ``/begin_weight_update`` and ``/end_weight_update`` (else 400 ``{"success": false, "message"}``, and no
  collective is entered); each update flushes the cache unless ``flush_cache=false``, and a flush refused
  because requests are running or queued fails the update call (the weights are loaded all the same);
* the weight group is joined exactly as ``init_custom_process_group`` does (``weight_group.py``);
* ``sampling_seed`` is honoured only with ``--enable-deterministic-inference``, and then all ``n`` children
  of a request share it (42 when absent); ``min_p > 0`` makes SGLang's seeded sampler assert, which takes the
  server down (here: 500, then the server stops; so do the memory-tag misuses, ``scheduler_rules.py``);
* ``return_sampling_mask``: top_k must be 1 or in [2, ``--sampling-mask-max-tokens``] (else 400), and a sampling
  support over that cap (ties at the top-k cutoff count) fails the whole batch with 400;
* ``/pause_generation`` ``in_place`` and ``retract`` (``pause.py``); ``/flush_cache`` needs SGLang's
  ``is_fully_idle`` (requests held in place refuse it, retracted ones do not);
* a batch (lists of ``input_ids``, ``sampling_params``, ``rid``) is one request per item, which keeps its rid
  and seed when ``n = 1`` (a string ``rid`` becomes ``rid_i``); answered when every item is done;
* ``n > 1`` children get fresh ids; prompt ids ``>= vocab_size - 1`` are reported as 0 in
  ``input_token_logprobs``; ``output_token_logprobs`` are always "raw", the "processed" ones come as
  ``output_token_sampling_logprobs`` with ``return_sampling_mask``;
* ``routed_experts`` has one column block per decoder layer (zeros for dense layers);
* error bodies: ``{"error": {"message"}}`` (request errors), ``{"error": "..."}`` (schema contract),
  ``{"detail": ...}`` (FastAPI validation 422, 404, 405); ``/model_info`` carries ``weight_version``,
  ``/server_info`` the launch settings (``tp_size``, ``enable_deterministic_inference``, ...), and
  ``/get_weight_version`` does not exist;
* ``/health`` is 503 while the engine cannot answer a one-token generation within ``--health-timeout``
  (wedged, paused, memory released).

Only this server has (extensions the SGLang client path never relies on): the ``safetensors`` and
``safetensors_file`` load formats of ``/update_weights_from_tensor`` (files only from its shared-memory
folder), ``"engine": "embedded"`` in ``/server_info``, ``--tp-size N`` (the engine is one process, but it
reports ``tp_size`` N and reads SGLang's per-rank tensor payloads as N ranks would: one entry per rank, each
decoded and required to hold the whole bucket; a weight group it joins as one rank, so only with N = 1),
a weight update while the ``weights`` memory is released refused (SGLang would write into unmapped
memory), and request caps (``--max-n``, ``--max-request-rows``, ``--max-request-tokens``: 400 naming the
limit) so that one request cannot exhaust the machine. Every ``/generate`` is checked field by field as SGLang
checks it before it can join the shared batch (``request_validation.py``); bodies, chunked or not, and strict JSON
answers: ``http_body.py``; what a client may make the server store, write or wait for (weight versions, NaN/inf
buckets, ``/start_profile`` only inside ``--profile-dir``, a weight group's master): ``guards.py``.
Not supported (a clear 400): text input, streaming, images, LoRA, grammars.

Run: ``python -m megatron_rl.rollout.embedded.server --model-path DIR [--port N] [--enable-deterministic-inference]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from megatron_rl.rollout.client import wire
from megatron_rl.rollout.client.protocol import GenerateRequest, SamplingParams
from megatron_rl.rollout.embedded.engine import (
    EmbeddedEngine, EmbeddedEngineConfig, EngineUnavailableError, SamplerAssertionError,
)
from megatron_rl.rollout.embedded import request_validation
from megatron_rl.rollout.embedded.generation_queue import GenerationQueue
from megatron_rl.rollout.embedded.http_handler import (
    HTTPError, HTTPServer, make_handler, request_error, validation_error,
)
from megatron_rl.rollout.client.mask_overflow import overflowed
from megatron_rl.rollout.embedded.scheduler_rules import (
    SchedulerCrash, check_sampling_mask,
)
from megatron_rl.rollout.embedded.control_endpoints import ControlEndpoints
from megatron_rl.rollout.embedded.weight_endpoints import WeightEndpoints
from megatron_rl.weights import group as weight_group

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"


@dataclass
class ServerLimits:
    """Per-request caps (this server's own; SGLang has none): beyond them a request is refused with 400."""

    max_n: int = 256
    max_rows: int = 4096  # prompts x n
    max_tokens: int = 1 << 22  # sum over rows of (prompt + max_new_tokens)

    def check(self, requests: List[GenerateRequest]) -> None:
        n = max(r.sampling.n for r in requests)
        rows = sum(r.sampling.n for r in requests)
        tokens = sum((len(r.prompt_ids) + r.sampling.max_new_tokens) * r.sampling.n for r in requests)
        for value, limit, what, flag in ((n, self.max_n, "sampling_params.n", "--max-n"),
                                         (rows, self.max_rows, "prompts x n", "--max-request-rows"),
                                         (tokens, self.max_tokens, "(prompt + max_new_tokens) x n summed",
                                          "--max-request-tokens")):
            if value > limit:
                raise request_error(f"{what} = {value} exceeds this server's limit of {limit} per request; split "
                                     f"the request or restart the server with a larger {flag}")


class EmbeddedServer(ControlEndpoints, WeightEndpoints):
    """``EmbeddedServer(engine).start()``; ``.url``; ``.stop()``. The engine's ``config.seeds`` decides the
    seed semantics: ``"deterministic"`` is SGLang with ``--enable-deterministic-inference``, ``"ignored"``
    without it."""

    def __init__(self, engine: EmbeddedEngine, host: str = "127.0.0.1", port: int = 0,
                 limits: Optional[ServerLimits] = None, health_timeout_s: float = 20.0,
                 model_path: Optional[str] = None, tp_size: int = 1, profile_dir: Optional[str] = None):
        if tp_size < 1:
            raise ValueError(f"tp_size={tp_size}: expected >= 1")
        self.engine = engine
        self.tp_size = tp_size  # emulated for /update_weights_from_tensor (one payload per rank); see the doc
        self.limits = limits or ServerLimits()
        self.health_timeout_s = health_timeout_s
        self.profile_dir = profile_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR", "/tmp")  # /start_profile's
        self.weight_group_connect_timeout_s = 30.0  # /init_weights_update_group: the master must listen by then
        self.model_path = model_path or getattr(engine.model.config, "_name_or_path", "") or "embedded"
        self.queue = GenerationQueue(engine)
        self._groups: Dict[str, Any] = {}
        self._session = False  # a weight-update session is open
        self._released: set = set()  # memory tags released
        self._capture = None  # a torch-profiler session over this process (/start_profile)
        self.crashed: Optional[str] = None  # why the server went down (crash())
        self._update_lock = threading.Lock()  # weight endpoints run one at a time, as SGLang's scheduler does
        self._routes: Dict[Tuple[str, str], Callable[[Dict[str, Any]], Any]] = {}
        for path, handler, methods in [
            ("/health", self._health, ("GET",)), ("/health_generate", self._health, ("GET",)),
            ("/model_info", self._model_info, ("GET",)), ("/get_model_info", self._model_info, ("GET",)),
            ("/server_info", self._server_info, ("GET",)), ("/get_server_info", self._server_info, ("GET",)),
            ("/generate", self._generate, ("POST", "PUT")),
            ("/begin_weight_update", self._begin_update, ("POST",)),
            ("/end_weight_update", self._end_update, ("POST",)),
            ("/update_weights_from_tensor", self._update_from_tensor, ("POST",)),
            ("/init_weights_update_group", self._init_group, ("POST",)),
            ("/update_weights_from_distributed", self._update_from_distributed, ("POST",)),
            ("/destroy_weights_update_group", self._destroy_group, ("POST",)),
            ("/flush_cache", self._flush_cache, ("GET", "POST")),
            ("/release_memory_occupation", self._release, ("GET", "POST")),
            ("/resume_memory_occupation", self._resume, ("GET", "POST")),
            ("/pause_generation", self._pause, ("POST",)), ("/continue_generation", self._continue, ("POST",)),
            ("/abort_request", self._abort, ("POST",)), ("/update_weight_version", self._set_version, ("POST",)),
            ("/start_profile", self._start_profile, ("GET", "POST")), ("/stop_profile", self._stop_profile, ("GET", "POST")),
        ]:
            for method in methods:
                self._routes[(method, path)] = handler
        self.httpd = HTTPServer((host, port), make_handler(self))
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def deterministic(self) -> bool:
        return self.engine.config.seeds == "deterministic"

    def start(self) -> "EmbeddedServer":
        # a short poll interval makes stop() return quickly (shutdown waits for the next poll)
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), name="embedded-server",
                                        daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.httpd.shutdown()
        self.engine.abort(abort_all=True)
        self.queue.stop()
        self.httpd.server_close()

    def crash(self, reason: str) -> None:
        """What SGLang does when its scheduler raises: the server goes down (``scheduler_rules.py``). This answer
        still goes out (500); the listening socket closes from another thread."""
        if self.crashed is None:
            self.crashed = reason
            log.error("Scheduler hit an exception: %s; the server goes down (as SGLang 0.5.23's does)", reason)
            threading.Thread(target=self.stop, name="embedded-server-crash", daemon=True).start()

    def dispatch(self, method: str, path: str, body: Any) -> Tuple[int, Any]:
        if self.crashed is not None:
            raise SchedulerCrash(f"the server is down: {self.crashed}")
        handler = self._routes.get((method, path))
        if handler is None:
            if any(p == path for _, p in self._routes):
                raise HTTPError(405, {"detail": "Method Not Allowed"})
            raise HTTPError(404, {"detail": "Not Found"})
        if not isinstance(body, dict):
            raise validation_error("body", "Input should be a valid dictionary", body)
        return handler(body)

    # ---- health and info ----------------------------------------------------------------------------

    def _health(self, body):
        """SGLang's health check generates one token; any output within the timeout means healthy."""
        h = self.engine.health()
        if not h.healthy or h.memory_released or h.paused:
            return 503, None
        tic = time.monotonic()
        if self.engine.busy_since is not None:  # a batch runs: healthy while it makes progress
            deadline = tic + self.health_timeout_s
            while time.monotonic() < deadline:
                if self.engine.last_progress > tic or self.engine.busy_since is None:
                    return 200, None
                time.sleep(0.05)
            log.error("health check failed: no decode step for %.0f s", self.health_timeout_s)
            return 503, None
        try:
            self.queue.submit([GenerateRequest((0,), _health_params(), rid=f"HEALTH_CHECK_{uuid.uuid4().hex}")],
                              timeout_s=self.health_timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure is unhealthy
            log.error("health check failed: %s", e)
            return 503, None
        return 200, None

    def _model_info(self, body):
        cfg = self.engine.model.config
        return 200, {"model_path": self.model_path, "served_model_name": self.model_path,
                     "tokenizer_path": self.model_path, "is_generation": True, "preferred_sampling_params": None,
                     "weight_version": self.engine.weight_version, "load_format": "auto",
                     "model_type": getattr(cfg, "model_type", None),
                     "architectures": getattr(cfg, "architectures", None)}

    def _server_info(self, body):
        layout = self.engine.routing.layout
        return 200, {"model_path": self.model_path, "tp_size": self.tp_size, "dp_size": 1, "pp_size": 1,
                     "enable_deterministic_inference": self.deterministic,
                     "enable_return_routed_experts": layout is not None,
                     "sampling_mask_max_tokens": self.engine.config.sampling_mask_max_tokens,
                     "context_length": self.engine.max_context, "random_seed": self.engine.config.seed,
                     "enable_memory_saver": True, "skip_tokenizer_init": True,
                     "version": SGLANG_VERSION, "engine": "embedded",  # "engine", "weight_checksum": extensions
                     "weight_checksum": True}

    # ---- generation ---------------------------------------------------------------------------------

    def _generate(self, body):
        try:  # each request's fields checked and normalised before any of them reaches the shared batch
            body = request_validation.normalize_generate_body(body, self.engine.model.config.vocab_size)
            requests, as_list, options = wire.parse_generate(body)
        except wire.BadRequest as e:
            raise (HTTPError(400, {"error": f"{e.field}: {e.message}"}) if e.contract
                   else request_error(f"{e.field}: {e.message}")) from None
        self.limits.check(requests)
        for r in requests:
            try:
                check_sampling_mask(r, self.engine.config.sampling_mask_max_tokens)
            except ValueError as e:
                raise request_error(str(e)) from None
        for i, r in enumerate(requests):
            try:
                self.engine.check_request(r)
            except SamplerAssertionError as e:
                raise SchedulerCrash(str(e)) from None
            except ValueError as e:
                raise request_error(str(e)) from None
            if len(r.prompt_ids) + r.sampling.max_new_tokens > self.engine.max_context:
                raise request_error(
                    f"Requested token count exceeds the model's maximum context length of {self.engine.max_context} "
                    f"tokens. You requested a total of {len(r.prompt_ids) + r.sampling.max_new_tokens} tokens: "
                    f"{len(r.prompt_ids)} tokens from the input messages and {r.sampling.max_new_tokens} tokens for "
                    "the completion. Please reduce the number of tokens in the input messages or the completion to "
                    "fit within the limit.")
        # SGLang (tokenizer_manager): a single request keeps its rid; n > 1 becomes n child requests with the
        # same sampling params (the same seed) and fresh rids each
        children = [(i, dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, n=1),
                                            rid=r.rid if r.sampling.n == 1 and r.rid else uuid.uuid4().hex))
                    for i, r in enumerate(requests) for _ in range(r.sampling.n)]
        try:
            samples = self.queue.submit([c for _, c in children])
        except EngineUnavailableError as e:
            raise request_error(str(e)) from None
        for s in samples:  # SGLang: one request's 400 abort fails the whole batch (scheduler_rules.py)
            if overflowed(s):
                raise request_error(s.abort_message)
        layout = self.engine.routing.layout
        vocab = self.engine.model.config.vocab_size
        prompt_lp: Dict[int, Any] = {}
        for i, r in enumerate(requests):
            start = options["logprob_start_len"][i]
            if options["return_logprob"][i] and start >= 0:
                # after generation, so both come from the weights the samples report
                scores = self.engine.prompt_logprobs(r.prompt_ids)[0]
                prompt_lp[i] = wire.input_logprob_entries(r.prompt_ids, scores, start, vocab)
        items = [wire.sample_to_json(s, options, i, requests[i].sampling.max_new_tokens, prompt_lp.get(i), layout)
                 for (i, _), s in zip(children, samples)]
        return 200, (items if as_list else items[0])


def _health_params():
    return SamplingParams(temperature=0.0, max_new_tokens=1)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description="SGLang-compatible HTTP server over an embedded transformers engine")
    p.add_argument("--model-path", required=True, help="HF model directory (config.json + weights)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed on start)")
    p.add_argument("--random-seed", type=int, default=0, help="the engine's own sampling stream")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="honour sampling_seed (shared by a request's n children; 42 when absent), as SGLang does")
    p.add_argument("--max-batch-rows", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", help="where the engine runs (cpu, cuda, cuda:1, ...)")
    p.add_argument("--max-n", type=int, default=ServerLimits.max_n)
    p.add_argument("--max-request-rows", type=int, default=ServerLimits.max_rows)
    p.add_argument("--max-request-tokens", type=int, default=ServerLimits.max_tokens)
    p.add_argument("--health-timeout", type=float, default=20.0, help="seconds without progress before /health is 503")
    p.add_argument("--tp-size", type=int, default=1, help="TP ranks emulated for tensor payloads (see the module doc)")
    p.add_argument("--profile-dir", default=None, help="the folder /start_profile may write in (default: "
                   "$SGLANG_TORCH_PROFILER_DIR, else /tmp); an output_dir outside it is refused")
    args = p.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    engine = EmbeddedEngine.from_pretrained(
        args.model_path, EmbeddedEngineConfig(seed=args.random_seed, max_batch_rows=args.max_batch_rows,
                                              seeds="deterministic" if args.enable_deterministic_inference
                                              else "ignored"),
        dtype=weight_group.dtype_from_name(args.dtype), device=args.device)
    torch.set_grad_enabled(False)
    server = EmbeddedServer(engine, args.host, args.port, ServerLimits(args.max_n, args.max_request_rows,
                                                                       args.max_request_tokens),
                            health_timeout_s=args.health_timeout, model_path=args.model_path, tp_size=args.tp_size,
                            profile_dir=args.profile_dir)
    print(f"embedded server listening on {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    if server.crashed is not None:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
