"""HTTP client for SGLang's native endpoints; the same class drives real SGLang and the embedded server.

Stdlib ``http.client`` (no new dependency), one connection per call (calls are long generations or rare
control messages, so connection reuse buys nothing and a fresh socket never inherits a broken one).

Failure policy (``RetryPolicy``):
* connection refused / reset / dropped, and 5xx except 501: retried with exponential backoff;
* a call that is not idempotent (joining a weight group, receiving a broadcast) is retried only when
  the connection was *refused* -- then the server provably never saw it (a 5xx is raised as ``ServerError``);
* ``restart_dead_server``: when a connection fails and the ``is_alive`` hook says the process is gone,
  call the ``restart`` hook (e.g. ``ManagedServer.restart``) before the next attempt;
* 4xx: never retried; raised as ``RequestRejected`` with the server's message (``wire.error_message``
  reads every error body SGLang sends);
* read timeouts: not retried by default (a slow generation retried is a doubled load).

SGLang 0.5.23 rules the client follows (each was a hang or a silent collapse against the real server):
a request's ``n`` samples go as one batch of ``n`` one-sample items, each with its own seed and rid (SGLang
gives every child of an ``n > 1`` request the same seed under deterministic inference, and fresh rids we
could not abort by; a batch item with ``n = 1`` keeps the seed and rid we send); unseeded samples still get
a random seed (SGLang would seed them all 42); weight versions are read from ``/model_info`` (there is no
``/get_weight_version``); routed experts are decoded with the model's
:class:`~megatron_rl.rollout.client.protocol.ExpertLayout`; "processed" log-probs are requested with
``return_sampling_mask`` and read from ``output_token_sampling_logprobs``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import logging
import secrets
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_rl.rollout.client import mask_overflow, wire
from megatron_rl.rollout.client.client_weights import WeightCalls
from megatron_rl.rollout.client.errors import RequestRejected, ServerError, ServerUnavailableError
from megatron_rl.rollout.client.protocol import ExpertLayout, GenerateRequest, Sample, derive_seed

log = logging.getLogger(__name__)

_CONNECTION_ERRORS = (ConnectionError, http.client.RemoteDisconnected, http.client.IncompleteRead,
                      http.client.BadStatusLine, BrokenPipeError)


@dataclass
class RetryPolicy:
    max_attempts: int = 4
    backoff_s: float = 0.5
    backoff_factor: float = 2.0
    max_backoff_s: float = 10.0
    retry_on_5xx: bool = True
    retry_on_timeout: bool = False
    restart_dead_server: bool = False

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts={self.max_attempts}: expected >= 1")

    def delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * self.backoff_factor ** attempt)


def _is_local_address(host: str) -> bool:
    """Whether ``host`` is an address of this machine (it can be bound here): loopback, or this node's IP."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


class SGLangClient(WeightCalls):
    def __init__(self, url: str, timeout_s: float = 600.0, retry: Optional[RetryPolicy] = None,
                 restart: Optional[Callable[[], None]] = None, is_alive: Optional[Callable[[], bool]] = None,
                 expert_layout: Optional[ExpertLayout] = None, logprob_mode: str = "raw",
                 shared_files: Optional[bool] = None, max_in_flight: int = 256, control_timeout_s: float = 30.0):
        parsed = urllib.parse.urlparse(url if "://" in url else f"http://{url}")
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ValueError(f"url={url!r}: expected http://host:port")
        self.url = f"http://{parsed.hostname}:{parsed.port}"
        self._host, self._port = parsed.hostname, parsed.port
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s  # control calls (pause, flush, memory, version): short
        self.retry = retry or RetryPolicy()
        self.restart, self.is_alive = restart, is_alive
        self.expert_layout = expert_layout  # to decode SGLang's routed_experts (MoE models)
        self.logprob_mode = logprob_mode  # "raw" (output_token_logprobs) or "processed" (sampling logprobs)
        # weights to a server on this machine go as shared-memory files (update_weights_from_tensor)
        self.shared_files = _is_local_address(self._host) if shared_files is None else shared_files
        self._lock = threading.Lock()
        self._children: Dict[str, List[str]] = {}  # in-flight request rid -> the rids of its n samples
        # samples in flight to this server: the server batches what is in flight, so this bounds its running batch
        # from our side (a request larger than the bound goes alone)
        self.max_in_flight = max_in_flight
        self._slots = threading.Condition()
        self._in_flight = 0
        self.mask_overflows = 0  # /generate batches refused over --sampling-mask-max-tokens (mask_overflow.py)
        self.mask_overflow_retries = 1

    def with_url(self, url: str) -> "SGLangClient":
        """A client with this one's settings for another server (a restarted engine's new address)."""
        return SGLangClient(url, self.timeout_s, self.retry, self.restart, self.is_alive, self.expert_layout,
                            self.logprob_mode, max_in_flight=self.max_in_flight,
                            control_timeout_s=self.control_timeout_s)

    # ---- transport ---------------------------------------------------------------------------------

    def _once(self, method: str, path: str, body: Any, timeout: float) -> Tuple[int, Any]:
        conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            headers = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            payload = json.loads(raw) if raw else None
        except ValueError:
            payload = raw.decode(errors="replace")  # SGLang answers some endpoints with plain text
        return resp.status, payload

    def request(self, method: str, path: str, body: Any = None, timeout_s: Optional[float] = None,
                idempotent: bool = True) -> Any:
        """One call with the retry policy; returns the decoded JSON (or text) of a 2xx answer."""
        policy, last = self.retry, "no attempt made"
        for attempt in range(policy.max_attempts):
            if attempt:
                time.sleep(policy.delay(attempt - 1))
            try:
                status, payload = self._once(method, path, body, timeout_s or self.timeout_s)
            except ConnectionRefusedError as e:
                last = f"connection refused ({e})"
                self._maybe_restart()
                continue
            except (socket.timeout, TimeoutError) as e:
                last = f"no answer within {timeout_s or self.timeout_s:.0f} s ({e})"
                if not policy.retry_on_timeout or not idempotent:
                    break
                continue
            except _CONNECTION_ERRORS + (OSError,) as e:
                last = f"connection lost: {type(e).__name__}: {e}"
                if not idempotent:
                    break
                self._maybe_restart()
                continue
            if 200 <= status < 300:
                return payload
            message = wire.error_message(payload)
            if 400 <= status < 500 or status == 501:
                cls = RequestRejected if status < 500 else ServerError
                raise cls(f"{method} {self.url}{path} -> {status}: {message}", self.url, status, payload)
            last = f"HTTP {status}: {message}"
            # a 5xx may come after the server acted (joined the group, received the bucket): never resent
            if not policy.retry_on_5xx or not idempotent:
                raise ServerError(f"{method} {self.url}{path} -> {last}", self.url, status, payload)
        hint = "" if self.restart is not None and policy.restart_dead_server else (
            "; if the server died, restart it or use RetryPolicy(restart_dead_server=True) with a restart hook")
        raise ServerUnavailableError(
            f"{method} {self.url}{path} failed after {attempt + 1} attempt(s): {last}{hint}", self.url)

    def _maybe_restart(self) -> None:
        if not (self.retry.restart_dead_server and self.restart is not None):
            return
        if self.is_alive is not None and self.is_alive():
            return  # alive but refusing: still starting, or a transient; back off and retry
        log.warning("server at %s is dead; restarting it", self.url)
        self.restart()

    # ---- endpoints ---------------------------------------------------------------------------------

    def health(self, timeout_s: float = 5.0) -> bool:
        try:
            status, _ = self._once("GET", "/health", None, timeout_s)
        except (OSError, *_CONNECTION_ERRORS):
            return False
        return status == 200

    def server_info(self) -> Dict[str, Any]:
        """The server's launch settings (``tp_size``, ``enable_deterministic_inference``, ...)."""
        return self.request("GET", "/server_info")

    def model_info(self) -> Dict[str, Any]:
        return self.request("GET", "/model_info")

    def get_weight_version(self) -> str:
        return str(self.model_info().get("weight_version"))

    def generate_raw(self, body: Dict[str, Any]) -> Any:
        return self.request("POST", "/generate", body)

    def generate_one(self, req: GenerateRequest) -> List[Sample]:
        """One request -> its ``n`` samples, sent as one ``/generate`` batch of ``n`` one-sample items, each with its
        own seed (``derive_seed(seed, j)``; a random seed when the request has none) and rid (``rid-j``). A batch
        refused over ``--sampling-mask-max-tokens`` is sent again or dropped (``mask_overflow.py``)."""
        base = req.sampling.seed if req.sampling.seed is not None else secrets.randbits(63)
        # "processed" differs from "raw" only under a filter; unfiltered, SGLang's support is the whole vocabulary
        # (and over --sampling-mask-max-tokens it refuses the batch)
        processed = self.logprob_mode == "processed" and req.sampling.filtered
        for attempt in range(1 + self.mask_overflow_retries):
            children = self._children_of(req, base if attempt == 0 else mask_overflow.retry_seed(base, attempt))
            try:
                return self._generate_children(req, children, processed)
            except RequestRejected as e:
                if not mask_overflow.is_overflow(e):
                    raise
                with self._lock:
                    self.mask_overflows += 1
                last = wire.error_message(e.payload) or str(e)
                log.warning("%s refused a group of %d samples over --sampling-mask-max-tokens (attempt %d of %d%s): "
                            "%s", self.url, len(children), attempt + 1, 1 + self.mask_overflow_retries,
                            "; sending it again with fresh seeds" if attempt < self.mask_overflow_retries else
                            "; the group is dropped (aborted samples)", last)
        return mask_overflow.aborted_group(children, last, "processed")

    def _children_of(self, req: GenerateRequest, base: int) -> List[GenerateRequest]:
        rid = req.rid or secrets.token_hex(16)
        n = req.sampling.n
        return [GenerateRequest(req.prompt_ids, dataclasses.replace(req.sampling, n=1, seed=derive_seed(base, j)),
                                req.return_top_logprobs, req.return_routed_experts, rid if n == 1 else f"{rid}-{j}",
                                req.return_sampling_logprobs) for j in range(n)]

    def _generate_children(self, req: GenerateRequest, children: List[GenerateRequest], processed: bool) -> List[Sample]:
        n, rid = len(children), req.rid or children[0].rid
        body = (wire.request_to_json(children[0], sampling_logprobs=processed) if n == 1 else
                wire.batch_request_to_json(children, sampling_logprobs=processed))
        with self._lock:
            self._children[rid] = [c.rid for c in children]
        try:
            with self._samples_in_flight(n):
                answer = self.generate_raw(body)
        finally:
            with self._lock:
                self._children.pop(rid, None)
        items = answer if isinstance(answer, list) else [answer]
        if len(items) != n:
            raise ServerError(f"/generate answered {len(items)} items for {n} samples", self.url)
        samples = []
        for j, (item, child) in enumerate(zip(items, children)):
            sample = wire.sample_from_json(item, child, j, self.expert_layout, "processed" if processed else "raw")
            if not req.sampling.filtered:
                sample.logprob_mode = self.logprob_mode  # the two conventions coincide
            samples.append(sample)
        return samples

    @contextlib.contextmanager
    def _samples_in_flight(self, n: int):
        with self._slots:
            while self._in_flight and self._in_flight + n > self.max_in_flight:
                self._slots.wait()
            self._in_flight += n
        try:
            yield
        finally:
            with self._slots:
                self._in_flight -= n
                self._slots.notify_all()

    def prompt_logprobs(self, token_ids: Sequence[int]) -> torch.Tensor:
        """``[L - 1]`` teacher-forced log-probs of ``token_ids[1:]`` (``input_token_logprobs``, temperature 1)."""
        return wire.parse_input_logprobs(self.generate_raw(wire.prompt_logprobs_request(token_ids)), token_ids)

    def prompt_logprobs_and_routes(self, token_ids: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`prompt_logprobs`, plus the ``[L, moe layers, topk]`` experts the server routed each token to."""
        if self.expert_layout is None:
            raise ValueError("prompt routes need the client's expert_layout (an MoE model)")
        answer = self.generate_raw(wire.prompt_logprobs_request(token_ids, routed_experts=True))
        return (wire.parse_input_logprobs(answer, token_ids),
                wire.parse_prompt_routes(answer, len(token_ids), self.expert_layout))

    def _control(self, path: str, body: Any, timeout_s: Optional[float]) -> Any:
        """A control call, bounded by ``timeout_s`` (default ``control_timeout_s``): an engine that does not answer
        raises ``ServerUnavailableError`` (engine recovery's cue) instead of holding the caller for
        ``request_timeout_s``."""
        return self.request("POST", path, body, timeout_s=timeout_s or self.control_timeout_s)

    def flush_cache(self, timeout_s: Optional[float] = None) -> None:
        """Drop the prefix cache (KV computed by the old weights); refused (400) while requests run."""
        self._control("/flush_cache", {}, timeout_s)

    def release_memory_occupation(self, tags: Optional[List[str]] = None, timeout_s: Optional[float] = None) -> None:
        self._control("/release_memory_occupation", {"tags": tags} if tags else {}, timeout_s)

    def resume_memory_occupation(self, tags: Optional[List[str]] = None, timeout_s: Optional[float] = None) -> None:
        self._control("/resume_memory_occupation", {"tags": tags} if tags else {}, timeout_s)

    def pause_generation(self, mode: str = "abort", timeout_s: Optional[float] = None) -> None:
        self._control("/pause_generation", {"mode": mode}, timeout_s)

    def continue_generation(self, timeout_s: Optional[float] = None) -> None:
        self._control("/continue_generation", {}, timeout_s)

    def abort_request(self, rid: Optional[str] = None, abort_all: bool = False,
                      timeout_s: Optional[float] = None) -> None:
        """Abort every sample of the request ``rid`` (by the rids this client gave them), or everything."""
        if abort_all:
            self._control("/abort_request", {"abort_all": True}, timeout_s)
            return
        with self._lock:
            rids = list(self._children.get(rid, [rid]))
        for r in rids:
            self._control("/abort_request", {"rid": r, "abort_all": False}, timeout_s)

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False,
                              timeout_s: Optional[float] = None) -> None:
        self._expect_success(self._control("/update_weight_version", {"new_version": str(new_version),
                                                                      "abort_all_requests": abort_all_requests},
                                           timeout_s))

    def _expect_success(self, answer: Any) -> None:
        if isinstance(answer, dict) and answer.get("success") is False:
            raise ServerError(f"{self.url} reported failure: {answer.get('message')}", self.url, None, answer)
