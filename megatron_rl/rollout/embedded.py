"""The embedded rollout engine: a ``transformers`` causal LM sampled in-process (CPU or one GPU).

Serves the same protocol as SGLang so the whole RL loop runs and is tested without a GPU. Its own
decode loop (left-padded batch + KV cache) rather than ``model.generate`` because we need: one RNG per
sample (seeded generation independent of batch composition), SGLang's top-k/top-p/min-p semantics,
exact log-probs of the sampled tokens under a chosen convention (``protocol.py``), and router capture.

How request seeds are used (``EmbeddedEngineConfig.seeds``):

* ``"derived"`` (in-process use): sample ``j`` of a request seeded ``s`` draws from ``derive_seed(s, j)``;
  an unseeded request takes a seed from the engine's own stream (``config.seed``, arrival order).
* ``"deterministic"``: SGLang 0.5.23 with ``--enable-deterministic-inference`` -- every sample of a request
  uses the request's ``sampling_seed``, 42 when it has none, so the ``n`` children of one request (and all
  unseeded requests) produce the same tokens (``srt/sampling/sampling_batch_info.py``); ``min_p > 0`` is
  refused, as SGLang's seeded sampler asserts on it.
* ``"ignored"``: SGLang without that flag -- ``sampling_seed`` has no effect, every sample draws from the
  engine's stream.

Rows are built lazily, ``max_batch_rows`` at a time, so a request's size costs memory per batch, not per
request (the HTTP server also caps it).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_rl.rollout.hf_weights import HFWeightTarget
from megatron_rl.rollout.protocol import (
    LOGPROB_MODES, EngineHealth, GenerateRequest, NamedTensorBucket, RolloutEngine, Sample,
)
from megatron_rl.rollout.routing import RoutingRecorder
from megatron_rl.rollout.sampling import RowParams, derive_seed, make_generator, sample_next
from megatron_rl.rollout.weight_versions import WeightVersionEvent, compute_spans, record_event


SEED_MODES = ("derived", "deterministic", "ignored")
SGLANG_DEFAULT_SEED = 42  # what SGLang's deterministic sampler uses for a request without sampling_seed


class EngineUnavailableError(RuntimeError):
    """The engine cannot generate now (memory released, or shut down)."""


class SamplerAssertionError(RuntimeError):
    """A request SGLang's sampler would assert on (its scheduler dies there); the server answers 500."""


@dataclass
class EmbeddedEngineConfig:
    logprob_mode: str = "raw"  # "raw" (SGLang's default) or "processed"; see protocol.py
    eos_token_ids: Optional[Tuple[int, ...]] = None  # None: the model config's eos_token_id
    max_batch_rows: int = 64  # sampled sequences per forward pass (requests x n)
    seed: int = 0  # the engine's own seed stream (unseeded requests, arrival order)
    fill_last_routing: bool = True  # one extra decode step to route the last response token
    max_context: Optional[int] = None  # None: config.max_position_embeddings
    seeds: str = "derived"  # how request seeds are used: see the module doc
    sampling_mask_max_tokens: int = 4096  # SGLang's --sampling-mask-max-tokens: larger supports abort

    def __post_init__(self) -> None:
        if self.logprob_mode not in LOGPROB_MODES:
            raise ValueError(f"EmbeddedEngineConfig.logprob_mode={self.logprob_mode!r}: "
                             f"expected one of {LOGPROB_MODES}")
        if self.max_batch_rows < 1:
            raise ValueError(f"EmbeddedEngineConfig.max_batch_rows={self.max_batch_rows}: expected >= 1")
        if self.seeds not in SEED_MODES:
            raise ValueError(f"EmbeddedEngineConfig.seeds={self.seeds!r}: expected one of {SEED_MODES}")


@dataclass
class _Row:
    """One sequence being sampled: request ``req``'s sample number ``index``."""

    req: GenerateRequest
    index: int
    seed: int
    rid: str
    tokens: List[int]
    logprobs: List[float]
    top_ids: List[torch.Tensor]
    top_values: List[torch.Tensor]
    finish: Optional[str] = None
    matched: Optional[int] = None
    processed: Optional[List[float]] = None  # "processed" log-probs, when the request asked for them
    abort_message: Optional[str] = None
    version_events: List[WeightVersionEvent] = field(default_factory=list)  # weight_versions.py


def _eos_ids(model: torch.nn.Module) -> Tuple[int, ...]:
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(cfg, "eos_token_id", None)
        if eos is not None:
            return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return ()


class EmbeddedEngine(RolloutEngine):
    def __init__(self, model: torch.nn.Module, config: Optional[EmbeddedEngineConfig] = None):
        self.config = config or EmbeddedEngineConfig()
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.eos_ids = tuple(self.config.eos_token_ids) if self.config.eos_token_ids is not None else _eos_ids(model)
        self.max_context = self.config.max_context or getattr(model.config, "max_position_embeddings", 1 << 30)
        self.routing = RoutingRecorder(model)
        self.weights = HFWeightTarget(model)
        self.weight_version = "default"
        # version changes are recorded on the rows being generated (SGLang's weight-version spans); the lock
        # orders them with token appends, since a version change may come from another thread mid-batch
        self._version_lock = threading.Lock()
        self._live: List[_Row] = []
        self.weights_consistent = True  # False after a failed multi-bucket update (see update_weights)
        self._lock = threading.RLock()  # one forward pass sequence at a time; weight updates wait for it
        self._seed_gen = make_generator(self.config.seed)
        self._released = False
        self._offloaded: Optional[dict] = None
        self._shut = False
        self._aborted: set = set()
        self._abort_epoch = 0
        self._unpaused = threading.Event()
        self._unpaused.set()
        self.busy_since: Optional[float] = None  # monotonic time a batch started (None: idle)
        self.last_progress = time.monotonic()  # monotonic time of the last prefill / decode step
        # transformers 5 renamed forward(past_key_values=) to forward(cache=); keep both working
        # (remove the old spelling once setup.py requires transformers>=5).
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @classmethod
    def from_pretrained(cls, path: str, config: Optional[EmbeddedEngineConfig] = None,
                        dtype: torch.dtype = torch.float32, device: str = "cpu") -> "EmbeddedEngine":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        return cls(model, config)

    # ---- protocol -------------------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerateRequest]) -> List[Sample]:
        for req in requests:
            self.check_request(req)
        rows = itertools.chain.from_iterable(self.rows(req) for req in requests)
        samples: List[Sample] = []
        while True:
            batch = list(itertools.islice(rows, self.config.max_batch_rows))
            if not batch:
                return samples
            samples.extend(self.generate_rows(batch))

    def _stream_seed(self) -> int:
        with self._lock:  # the stream is shared: draw under the lock to keep arrival order
            return int(torch.randint(0, 2**62, (), generator=self._seed_gen))

    def rows(self, req: GenerateRequest) -> Iterator["_Row"]:
        """The ``n`` sequences to sample for ``req``, built one at a time (seeds: module doc)."""
        rid = req.rid or uuid.uuid4().hex
        mode, seed = self.config.seeds, req.sampling.seed
        if mode == "derived" and seed is None:
            seed = self._stream_seed()
        if mode == "deterministic" and seed is None:
            seed = SGLANG_DEFAULT_SEED
        for j in range(req.sampling.n):
            row_seed = {"derived": lambda: derive_seed(seed, j), "deterministic": lambda: seed,
                        "ignored": self._stream_seed}[mode]()
            yield _Row(req, j, row_seed, rid, [], [], [], [], processed=[] if req.return_sampling_logprobs else None)

    def check_request(self, req: GenerateRequest) -> None:
        """Raise ValueError if this engine cannot serve ``req`` (the server answers 400 with it)."""
        if not isinstance(req, GenerateRequest):
            raise TypeError(f"generate() takes GenerateRequest objects, got {type(req).__name__}")
        if req.return_routed_experts and not self.routing.is_moe:
            raise ValueError("return_routed_experts=True but the model has no sparse-MoE layers")
        if len(req.prompt_ids) >= self.max_context:
            raise ValueError(f"prompt of {len(req.prompt_ids)} tokens leaves no room in the context "
                             f"length {self.max_context}; shorten it")
        vocab = self.model.config.vocab_size
        if max(req.prompt_ids) >= vocab:
            raise ValueError(f"prompt token id {max(req.prompt_ids)} >= vocab_size {vocab}")
        if self.config.seeds == "deterministic" and req.sampling.min_p > 0 and not req.sampling.greedy:
            raise SamplerAssertionError(
                "AssertionError: With sampling seed, multinomial_with_seed will provide wrong results "
                f"(min_p={req.sampling.min_p} with --enable-deterministic-inference: SGLang 0.5.23's sampler "
                "asserts here, srt/layers/sampler.py); use min_p=0")

    def update_weights(self, named_tensor_buckets: Iterable[NamedTensorBucket], version: Any) -> None:
        """Copy every bucket into the model, then set the version. Each bucket is validated whole before
        any of it is copied; if bucket ``k`` is rejected, buckets ``< k`` stay applied, the version is not
        advanced and ``weights_consistent`` turns False (reported by ``health``) until a full update."""
        with self._lock:
            self._require_live()
            applied = 0
            try:
                for bucket in named_tensor_buckets:
                    self.weights.copy_bucket(bucket)  # raises before copying anything of a bad bucket
                    applied += 1
            except Exception:
                if applied:
                    self.weights_consistent = False
                raise
            self.weights_consistent = True
            self.update_weight_version(version)

    @contextlib.contextmanager
    def weight_update(self, version: Any) -> Iterator[HFWeightTarget]:
        """Write the weights in place (a per-rank weight sync assembles trainer shards into them), then set
        the version; an exception inside leaves ``weights_consistent`` False until a full update."""
        with self._lock:
            self._require_live()
            try:
                yield self.weights
            except BaseException:
                self.weights_consistent = False
                raise
            self.weights_consistent = True
            self.update_weight_version(version)

    def update_weight_version(self, version: Any) -> None:
        """Set the version reported from now on; rows being generated record the change (SGLang's
        ``record_weight_version_change``), so their later tokens are attributed to ``version``."""
        with self._version_lock:
            version = str(version)
            if version != self.weight_version:
                for r in self._live:
                    record_event(r.version_events, self.weight_version, len(r.tokens))
                self.weight_version = version

    def prompt_logprobs(self, token_ids: Sequence[int]) -> List[torch.Tensor]:
        """``[L - 1]`` teacher-forced log-probs of ``token_ids[1:]`` at temperature 1 (protocol doc), from one
        forward of the unpadded sequence (no KV cache, so nothing depends on how generation batches)."""
        self.check_request(GenerateRequest(tuple(token_ids)))  # ids in the vocabulary, room in the context
        with self._lock, torch.no_grad():
            self._require_live()
            if self._released:
                raise EngineUnavailableError("engine memory is released; call resume_memory() before scoring")
            ids = torch.tensor([list(token_ids)], device=self.device)
            logits = self.model(input_ids=ids).logits[0, :-1].float()  # [L-1, V]: position t predicts t+1
            logprobs = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None]).squeeze(1)
        return [logprobs.cpu()]

    def prompt_logprobs_and_routes(self, token_ids: Sequence[int]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`prompt_logprobs` plus the ``[L, MoE layers, topk]`` experts each token was routed to, from the
        same forward (one replica)."""
        if not self.routing.is_moe:
            raise ValueError("prompt routes need an MoE model")
        with self._lock:
            self.routing.pop()
            self.routing.enabled = True
            try:
                (logprobs,) = self.prompt_logprobs(token_ids)
                layers = self.routing.pop()
            finally:
                self.routing.enabled = False
        return [(logprobs, torch.stack(layers, dim=1))]

    def release_memory(self) -> None:
        """On CUDA: move weights to host memory, freeing the device. On CPU there is nothing to hand to a
        colocated trainer (weights already live in host memory), so only the state changes: ``generate``
        refuses until ``resume_memory`` -- the same contract the driver sees with SGLang."""
        with self._lock:
            self._require_live()
            if self._released:
                return
            if self.device.type != "cpu":
                self._offloaded = {"device": self.device}
                self.model.to("cpu")
                torch.cuda.empty_cache()
            self._released = True

    def resume_memory(self) -> None:
        with self._lock:
            self._require_live()
            if self._offloaded is not None:
                self.model.to(self._offloaded["device"])
                self._offloaded = None
            self._released = False

    def health(self) -> EngineHealth:
        detail = "" if self.weights_consistent else "a weight update failed part-way; weights are mixed"
        return EngineHealth(healthy=not self._shut and self.weights_consistent, weight_version=self.weight_version,
                            memory_released=self._released, paused=not self._unpaused.is_set(), detail=detail)

    def shutdown(self) -> None:
        with self._lock:
            self._shut = True
            self.routing.remove()
            self._unpaused.set()

    # ---- control used by the HTTP server ----------------------------------------------------------

    def abort(self, rid: Optional[str] = None, abort_all: bool = False) -> None:
        """Finish the named (or every) running request with ``finish_reason="abort"`` at the next step."""
        if abort_all:
            self._abort_epoch += 1
        elif rid is not None:
            self._aborted.add(rid)

    def pause(self) -> None:
        """Hold running requests in place between decode steps (SGLang ``pause_generation`` in_place)."""
        self._unpaused.clear()

    def continue_generation(self) -> None:
        self._unpaused.set()

    @property
    def paused(self) -> bool:
        return not self._unpaused.is_set()

    def live_tokens(self) -> List[int]:
        """Tokens generated so far by each sequence of the running batch (progress, for tests and tools)."""
        with self._version_lock:
            return [len(r.tokens) for r in self._live]

    # ---- the decode loop --------------------------------------------------------------------------

    def _require_live(self) -> None:
        if self._shut:
            raise EngineUnavailableError("the engine was shut down")

    def _forward(self, ids, mask, pos, cache):
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         logits_to_keep=1, **{self._cache_kw: cache})
        new_cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        return out.logits[:, -1, :], new_cache

    def aborted_sample(self, row: _Row) -> Sample:
        """The answer for a row aborted before it was generated."""
        version = self.weight_version
        return Sample(prompt_ids=list(row.req.prompt_ids), response_ids=[], logprobs=[], finish_reason="abort",
                      weight_version=version, logprob_mode=self.config.logprob_mode, rid=row.rid,
                      sample_index=row.index, sampling_logprobs=[] if row.processed is not None else None,
                      weight_versions=compute_spans([], version, 0))

    def generate_rows(self, rows: List[_Row]) -> List[Sample]:
        """Sample one batch of rows (from :meth:`rows`) to the end; one sample per row, in order."""
        with self._lock, torch.no_grad():
            self._require_live()
            if self._released:
                raise EngineUnavailableError("engine memory is released; call resume_memory() before generate()")
            self.busy_since = self.last_progress = time.monotonic()
            try:
                return self._generate_rows(rows)
            finally:
                self.busy_since = None

    def _generate_rows(self, rows: List[_Row]) -> List[Sample]:
        epoch = self._abort_epoch
        B = len(rows)
        lens = [len(r.req.prompt_ids) for r in rows]
        P = max(lens)
        ids = torch.tensor([[0] * (P - n) + list(r.req.prompt_ids) for r, n in zip(rows, lens)], device=self.device)
        mask = torch.tensor([[0] * (P - n) + [1] * n for n in lens], device=self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        params = RowParams.from_params([r.req.sampling for r in rows])
        gens = [make_generator(r.seed) for r in rows]
        top_n = max(r.req.return_top_logprobs for r in rows)
        want_routes = any(r.req.return_routed_experts for r in rows)
        self.routing.enabled = want_routes
        routes: List[List[torch.Tensor]] = []  # per forward: [L] x [B*S, K]
        limits = [min(r.req.sampling.max_new_tokens, self.max_context - n) for r, n in zip(rows, lens)]
        with self._version_lock:
            self._live = rows
        try:
            self._wait_if_paused(epoch)
            logits, cache = self._prefill(rows, ids, mask, pos, share=not want_routes)
            if want_routes:
                routes.append(self.routing.pop())
            for step in itertools.count():
                res = sample_next(logits, params, gens, self.config.logprob_mode, top_n)
                self._record_step(rows, res, limits, epoch)
                if all(r.finish for r in rows):
                    break
                self._wait_if_paused(epoch)
                mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
                pos = pos[:, -1:] + 1
                logits, cache = self._forward(res.tokens.unsqueeze(1).to(self.device), mask, pos, cache)
                if want_routes:
                    routes.append(self.routing.pop())
            if want_routes and self.config.fill_last_routing:
                mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
                self._forward(res.tokens.unsqueeze(1).to(self.device), mask, pos[:, -1:] + 1, cache)
                routes.append(self.routing.pop())
        finally:
            self.routing.enabled = False
            self.routing.pop()
            for r in rows:
                self._aborted.discard(r.rid)
            with self._version_lock:  # the spans are final once the rows leave the live set
                self._live = []
                spans = [compute_spans(r.version_events, self.weight_version, len(r.tokens)) for r in rows]
        return [self._to_sample(b, r, lens[b], P, routes, spans[b]) for b, r in enumerate(rows)]

    def _prefill(self, rows: List[_Row], ids, mask, pos, share: bool):
        """The prompt forward of a batch: ``(last-position logits [B, V], KV cache of B rows)``.

        Rows with the same prompt (the ``n`` samples of a request, SGLang's shared prefix) share one
        forward: the distinct prompts are run once and their logits and cache rows are copied out to
        every row that has them -- for ``n = 8`` an eighth of the prefill's work. (Float rounding may
        differ from an unshared prefill by ~1e-7, as any change of batch composition does.)
        Not with routing capture, whose prefill records are per row."""
        distinct: dict = {}
        source = [distinct.setdefault(tuple(r.req.prompt_ids), i) for i, r in enumerate(rows)]
        if not share or len(distinct) == len(rows):
            return self._forward(ids, mask, pos, None)
        first = torch.tensor(sorted(distinct.values()), device=self.device)  # one row per distinct prompt
        logits, cache = self._forward(ids[first], mask[first], pos[first], None)
        if not hasattr(cache, "batch_select_indices"):  # a cache type we cannot expand: no sharing
            return self._forward(ids, mask, pos, None)
        where = {row: k for k, row in enumerate(first.tolist())}
        expand = torch.tensor([where[src] for src in source], device=self.device)
        cache.batch_select_indices(expand)
        return logits.index_select(0, expand), cache

    def _wait_if_paused(self, epoch: int) -> None:
        """Hold the batch while paused. The lock is let go meanwhile so weight updates and version changes
        go through (SGLang's in-place pause, used for partial rollouts): tokens after ``continue`` then
        come from the new weights (over the KV cache the old ones computed, as SGLang's in-place pause
        keeps it), and ``Sample.weight_versions`` says which version produced which tokens."""
        if self._unpaused.is_set():
            return
        self._lock.release()  # held exactly once here: _generate_rows is the only caller
        try:
            while not self._unpaused.wait(timeout=0.05):
                if self._abort_epoch != epoch or self._shut:
                    break
        finally:
            self._lock.acquire()
        self._require_live()
        if self._released:
            raise EngineUnavailableError("memory was released while generation was paused; the batch is lost")

    def _record_step(self, rows: List[_Row], res, limits: List[int], epoch: int) -> None:
        self.last_progress = time.monotonic()
        abort_all = self._abort_epoch != epoch
        tokens, logprobs = res.tokens.tolist(), res.logprobs.tolist()  # one conversion, not one per row
        processed, support = res.processed.tolist(), res.support.tolist()
        cap = self.config.sampling_mask_max_tokens
        for b, r in enumerate(rows):
            if r.finish:
                continue
            if abort_all or r.rid in self._aborted:
                r.finish = "abort"
                continue
            if r.processed is not None and support[b] > cap:  # SGLang aborts the request (status OVERFLOW)
                r.finish = "abort"
                r.abort_message = (f"Sampling support exceeds --sampling-mask-max-tokens={cap}, commonly because "
                                   "of cutoff ties. Lower top_k to leave more headroom or increase the server limit.")
                continue
            tok = tokens[b]
            with self._version_lock:
                r.tokens.append(tok)
            r.logprobs.append(logprobs[b])
            if r.processed is not None:
                r.processed.append(processed[b])
            if res.top_ids is not None and r.req.return_top_logprobs:
                r.top_ids.append(res.top_ids[b, : r.req.return_top_logprobs])
                r.top_values.append(res.top_values[b, : r.req.return_top_logprobs])
            sp = r.req.sampling
            if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos_ids):
                r.finish, r.matched = "stop", tok
            elif len(r.tokens) >= limits[b]:
                r.finish = "length"

    def _to_sample(self, b: int, r: _Row, n_prompt: int, P: int, routes: List[List[torch.Tensor]], spans) -> Sample:
        top_ids = torch.stack(r.top_ids) if r.top_ids else None
        top_values = torch.stack(r.top_values) if r.top_values else None
        routed = prompt_routed = None
        if r.req.return_routed_experts and routes:
            B = len(routes[0][0]) // P  # prefill records are [B*P, K]
            pre = torch.stack([layer.view(B, P, -1)[b, P - n_prompt:] for layer in routes[0]], dim=1)
            prompt_routed = pre  # [P_b, L, K]
            R = len(r.tokens)
            L, K = pre.shape[1], pre.shape[2]
            routed = torch.full((R, L, K), -1, dtype=torch.int32)
            # response token t is fed (and routed) by forward t+1; rows of forwards not run stay -1.
            for t in range(min(R, len(routes) - 1)):
                routed[t] = torch.stack([layer[b] for layer in routes[t + 1]], dim=0)
        return Sample(
            prompt_ids=list(r.req.prompt_ids), response_ids=r.tokens, logprobs=r.logprobs,
            finish_reason=r.finish or "abort", matched_stop=r.matched, top_logprob_ids=top_ids,
            top_logprob_values=top_values, routed_experts=routed, prompt_routed_experts=prompt_routed,
            weight_version=spans[-1].version, logprob_mode=self.config.logprob_mode, rid=r.rid,
            sample_index=r.index, sampling_logprobs=r.processed, abort_message=r.abort_message, weight_versions=spans,
        )
