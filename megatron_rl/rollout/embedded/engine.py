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

Rows are built lazily, as places in the running batch free up, so a request's size costs memory per batch, not per
request (the HTTP server also caps it).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from transformers import AutoModelForCausalLM

from megatron_rl.rollout.client.protocol import (
    LOGPROB_MODES, EngineHealth, GenerateRequest, RolloutEngine, Sample, derive_seed,
)
from megatron_rl.rollout.client.weight_versions import record_event
from megatron_rl.rollout.embedded.decode_batch import Row
from megatron_rl.rollout.embedded.decode_loop import DecodeLoop, EngineUnavailableError
from megatron_rl.rollout.embedded.hf_weights import HFWeightTarget
from megatron_rl.rollout.embedded.routing import RoutingRecorder
from megatron_rl.rollout.embedded.sampling import make_generator
from megatron_rl.weights.receiver import NamedTensorBucket

SEED_MODES = ("derived", "deterministic", "ignored")
SGLANG_DEFAULT_SEED = 42  # what SGLang's deterministic sampler uses for a request without sampling_seed


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


class _Task:
    def __init__(self, fn: Callable[[], Any]):
        self.fn, self.result, self.error, self.done = fn, None, None, threading.Event()


def _eos_ids(model: torch.nn.Module) -> Tuple[int, ...]:
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(cfg, "eos_token_id", None)
        if eos is not None:
            return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return ()


class EmbeddedEngine(DecodeLoop, RolloutEngine):
    """A transformers model sampled in-process (module doc); the continuous-batching loop is DecodeLoop's."""

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
        self._live: List[Row] = []
        self.weights_consistent = True  # False after a failed multi-bucket update (see update_weights)
        self._lock = threading.RLock()  # one forward pass sequence at a time; weight updates wait for it
        # threads waiting in _exclusive(): the running batch takes no new rows and hands the lock over once empty
        self._waiters = 0
        self._waiters_cv = threading.Condition()
        self._tasks: List[_Task] = []  # work run between decode steps (_on_engine)
        self._tasks_lock = threading.Lock()
        self._seed_gen = make_generator(self.config.seed)
        self._released = False
        self._offloaded: Optional[dict] = None
        self._shut = False
        self._aborted: set = set()
        self._abort_epoch = 0
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._pause_mode = "in_place"
        self.busy_since: Optional[float] = None  # monotonic time a batch started (None: idle)
        self.last_progress = time.monotonic()  # monotonic time of the last prefill / decode step
        # transformers 5 renamed forward(past_key_values=) to forward(cache=); keep both working
        # (remove the old spelling once setup.py requires transformers>=5).
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @classmethod
    def from_pretrained(cls, path: str, config: Optional[EmbeddedEngineConfig] = None,
                        dtype: torch.dtype = torch.float32, device: str = "cpu") -> "EmbeddedEngine":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        return cls(model, config)

    # ---- protocol -------------------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerateRequest]) -> List[Sample]:
        for req in requests:
            self.check_request(req)
        return self.generate_rows(itertools.chain.from_iterable(self.rows(req) for req in requests))

    def _stream_seed(self) -> int:
        with self._lock:  # the stream is shared: draw under the lock to keep arrival order
            return int(torch.randint(0, 2**62, (), generator=self._seed_gen))

    def rows(self, req: GenerateRequest) -> Iterator["Row"]:
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
            yield Row(req, j, row_seed, rid, [], [], [], [], processed=[] if req.return_sampling_logprobs else None)

    def check_request(self, req: GenerateRequest) -> None:
        """Raise ValueError if this engine cannot serve ``req`` (the server answers 400 with it)."""
        check_request(self, req)

    def update_weights(self, named_tensor_buckets: Iterable[NamedTensorBucket], version: Any) -> None:
        """Copy every bucket into the model, then set the version. Each bucket is validated whole before
        any of it is copied; if bucket ``k`` is rejected, buckets ``< k`` stay applied, the version is not
        advanced and ``weights_consistent`` turns False (reported by ``health``) until a full update."""
        with self._exclusive():
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

    def weights_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def receives_in_place(self) -> bool:
        return True  # weight_update() yields the live model's HFWeightTarget

    @contextlib.contextmanager
    def weight_update(self, version: Any) -> Iterator[HFWeightTarget]:
        """Write the weights in place (a per-rank weight sync assembles trainer shards into them), then set
        the version; an exception inside leaves ``weights_consistent`` False until a full update."""
        with self._exclusive():
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
        return [self._on_engine(lambda: self._score(token_ids))]

    def prompt_logprobs_and_routes(self, token_ids: Sequence[int]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`prompt_logprobs` plus the ``[L, MoE layers, topk]`` experts each token was routed to, from the
        same forward (one replica)."""
        if not self.routing.is_moe:
            raise ValueError("prompt routes need an MoE model")
        self.check_request(GenerateRequest(tuple(token_ids)))

        def score():
            self.routing.pop()
            self.routing.enabled = True
            try:
                logprobs = self._score(token_ids)
                return logprobs, torch.stack(self.routing.pop(), dim=1)
            finally:
                self.routing.enabled = False
        return [self._on_engine(score)]

    def _score(self, token_ids: Sequence[int]) -> torch.Tensor:
        self._require_live()
        if self._released:
            raise EngineUnavailableError("engine memory is released; call resume_memory() before scoring")
        with torch.no_grad():
            ids = torch.tensor([list(token_ids)], device=self.device)
            logits = self.model(input_ids=ids).logits[0, :-1].float()  # [L-1, V]: position t predicts t+1
            return torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None]).squeeze(1).cpu()

    def _on_engine(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` under the engine lock: between two decode steps of the running batch, or at once when none
        runs. Scoring does not wait for the batch to finish (SGLang scores a prompt inside its running batch;
        a weight-sync probe would otherwise stall generation until every running row is done)."""
        task = _Task(fn)
        with self._tasks_lock:
            self._tasks.append(task)
        while not task.done.is_set():
            if self._lock.acquire(timeout=0.005):  # no batch runs (or it is paused): run the tasks here
                try:
                    self._run_tasks()
                finally:
                    self._lock.release()
            else:
                task.done.wait(0.005)
        if task.error is not None:
            raise task.error
        return task.result

    def _run_tasks(self) -> None:
        with self._tasks_lock:
            tasks, self._tasks = self._tasks, []
        for task in tasks:
            try:
                task.result = task.fn()
            except BaseException as e:  # noqa: BLE001 - raised in the thread that asked
                task.error = e
            task.done.set()

    def release_memory(self) -> None:
        """On CUDA: move weights to host memory, freeing the device. On CPU there is nothing to hand to a
        colocated trainer (weights already live in host memory), so only the state changes: ``generate``
        refuses until ``resume_memory`` -- the same contract the driver sees with SGLang."""
        with self._exclusive():
            self._require_live()
            if self._released:
                return
            if self.device.type != "cpu":
                self._offloaded = {"device": self.device}
                self.model.to("cpu")
                torch.cuda.empty_cache()
            self._released = True

    def resume_memory(self) -> None:
        with self._exclusive():
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

    def pause(self, mode: str = "in_place") -> None:
        """Hold running requests between decode steps (SGLang ``pause_generation``): ``in_place`` keeps their KV
        cache, ``retract`` rebuilds it under the then current weights on ``continue_generation`` (``pause.py``)."""
        if mode not in ("in_place", "retract"):
            raise ValueError(f"pause mode={mode!r}: expected 'in_place' or 'retract'")
        self._pause_mode = mode
        self._unpaused.clear()

    def continue_generation(self) -> None:
        self._unpaused.set()

    @property
    def paused(self) -> bool:
        return not self._unpaused.is_set()

    @property
    def retracted(self) -> bool:
        """Paused with ``retract``: the held requests count as waiting, not running (``scheduler_rules.py``)."""
        return self.paused and self._pause_mode == "retract"

    def live_tokens(self) -> List[int]:
        """Tokens generated so far by each sequence of the running batch (progress, for tests and tools)."""
        with self._version_lock:
            return [len(r.tokens) for r in self._live]


def check_request(engine: "EmbeddedEngine", req: GenerateRequest) -> None:
    """Raise ValueError if ``engine`` cannot serve ``req`` (the server answers 400 with it)."""
    if not isinstance(req, GenerateRequest):
        raise TypeError(f"generate() takes GenerateRequest objects, got {type(req).__name__}")
    if req.return_routed_experts and not engine.routing.is_moe:
        raise ValueError("return_routed_experts=True but the model has no sparse-MoE layers")
    if len(req.prompt_ids) >= engine.max_context:
        raise ValueError(f"prompt of {len(req.prompt_ids)} tokens leaves no room in the context "
                         f"length {engine.max_context}; shorten it")
    vocab = engine.model.config.vocab_size
    if max(req.prompt_ids) >= vocab:
        raise ValueError(f"prompt token id {max(req.prompt_ids)} >= vocab_size {vocab}")
    if engine.config.seeds == "deterministic" and req.sampling.min_p > 0 and not req.sampling.greedy:
        raise SamplerAssertionError(
            "AssertionError: With sampling seed, multinomial_with_seed will provide wrong results "
            f"(min_p={req.sampling.min_p} with --enable-deterministic-inference: SGLang 0.5.23's sampler "
            "asserts here, srt/layers/sampler.py); use min_p=0")
