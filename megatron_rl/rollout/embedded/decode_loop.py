"""The embedded engine's decode loop: rows join a running batch between decode steps (continuous batching).

``DecodeLoop`` is the half of :class:`~megatron_rl.rollout.embedded.engine.EmbeddedEngine` that runs forwards:
the engine lock that generation shares with weight updates and probes (``_exclusive``), prefill of joining
rows, one decode step at a time, pause / abort, and the per-step bookkeeping (tokens, log-probs, routes,
weight-version spans). The state it uses is the engine's (set in ``EmbeddedEngine.__init__``).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from typing import Callable, Iterable, Iterator, List

import torch

from megatron_rl.rollout.client.mask_overflow import SAMPLING_MASK_OVERFLOW
from megatron_rl.rollout.client.protocol import Sample
from megatron_rl.rollout.client.weight_versions import compute_spans
from megatron_rl.rollout.embedded.decode_batch import DecodeBatch, Row
from megatron_rl.rollout.embedded.pause import reprefill
from megatron_rl.rollout.embedded.sampling import make_generator, sample_next


class EngineUnavailableError(RuntimeError):
    """The engine cannot generate now (memory released, or shut down)."""


class DecodeLoop:
    """Generation over a continuous batch; mixed into EmbeddedEngine (whose ``__init__`` sets the state)."""

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """The engine lock for anything but generation. Like SGLang's writer-preferring model-update lock, a
        waiter stops new rows from joining the running batch and gets the lock once the batch is empty (or
        paused: a paused batch lets go of it)."""
        with self._waiters_cv:
            self._waiters += 1
        try:
            self._lock.acquire()
        finally:
            with self._waiters_cv:
                self._waiters -= 1
                self._waiters_cv.notify_all()
        try:
            yield
        finally:
            self._lock.release()

    def _require_live(self) -> None:
        if self._shut:
            raise EngineUnavailableError("the engine was shut down")

    def _forward(self, ids, mask, pos, cache):
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         logits_to_keep=1, **{self._cache_kw: cache})
        new_cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        return out.logits[:, -1, :], new_cache

    def aborted_sample(self, row: Row) -> Sample:
        """The answer for a row aborted before it was generated."""
        return row.to_sample(compute_spans([], self.weight_version, 0), self.config.logprob_mode, finish="abort")

    def generate_rows(self, rows: Iterable[Row]) -> List[Sample]:
        """Sample ``rows`` (from :meth:`rows`) to the end; one sample per row, in order. Rows are pulled from the
        iterable only as places in the batch free up (``max_batch_rows``), never all up front."""
        source, order, out = iter(rows), [], {}

        def take(free: int) -> List[Row]:
            new = list(itertools.islice(source, free))
            order.extend(new)
            return new
        self.generate_stream(take, lambda row, sample: out.__setitem__(id(row), sample))
        return [out[id(r)] for r in order]

    def generate_stream(self, take: Callable[[int], List[Row]], deliver: Callable[[Row, Sample], None]) -> None:
        """Continuous batching: ``take(free)`` gives up to ``free`` rows to join the running batch between decode
        steps (until it gives none and the batch is empty); each row's sample goes to ``deliver(row, sample)``
        as soon as it is finished. A row's tokens do not depend on when it joins or who it runs with (one seeded
        generator per row); its log-probs may move by float rounding (~1e-6). Raises if generation fails; the
        rows not delivered are lost with the error."""
        with self._waiters_cv:
            self._waiters_cv.wait_for(lambda: self._waiters == 0)
        with self._lock, torch.no_grad():
            self._require_live()
            if self._released:
                raise EngineUnavailableError("engine memory is released; call resume_memory() before generate()")
            self.busy_since = self.last_progress = time.monotonic()
            batch = DecodeBatch()
            try:
                self._decode(batch, take, deliver)
            finally:
                self.busy_since = None
                self.routing.enabled = False
                self.routing.pop()
                for r in batch.rows:
                    self._aborted.discard(r.rid)
                with self._version_lock:
                    self._live = []

    def _decode(self, batch: DecodeBatch, take, deliver) -> None:
        # One iteration: [pause point] forward the batch's last tokens, prefill joining rows, sample. No pause
        # between a forward and the sampling of its logits: a token's version is that of the weights that
        # computed it.
        fill = self.config.fill_last_routing
        while True:
            self._wait_if_paused(batch)
            if self._tasks:
                self._run_tasks()
            if batch.rows:
                self.routing.enabled = batch.wants_routes
                batch.logits, batch.cache = self._forward(*batch.decode_inputs(), batch.cache)
                if batch.wants_routes:
                    for b, layers in enumerate(zip(*self.routing.pop())):
                        batch.rows[b].routes.append(torch.stack(layers, dim=0))
                done = [r.finish is not None for r in batch.rows]  # fed once more only for their routes
                if any(done):
                    self._deliver([r for r, d in zip(batch.rows, done) if d], deliver)
                    batch.keep([not d for d in done])
            free = self.config.max_batch_rows - len(batch)
            if free > 0 and self._waiters == 0 and batch.can_join():
                new = take(free)
                if new:
                    self._join(batch, new)
            if not batch.rows:
                return
            res = sample_next(batch.logits, batch.params, batch.generators, self.config.logprob_mode, batch.top_n)
            self._record_step(batch.rows, res)
            batch.tokens = res.tokens
            # a row that just finished leaves now, unless the forward of its last token is wanted for its routes
            feed = [r.finish is None or (fill and r.req.return_routed_experts and r.finish != "abort" and
                                         len(r.routes) < len(r.tokens)) for r in batch.rows]
            if not all(feed):
                self._deliver([r for r, f in zip(batch.rows, feed) if not f], deliver)
                batch.keep(feed)

    def _join(self, batch: DecodeBatch, rows: List[Row]) -> None:
        """Prefill ``rows`` and add them to the running batch."""
        lens = [len(r.req.prompt_ids) for r in rows]
        P = max(lens)
        for r, n in zip(rows, lens):
            r.generator, r.epoch, r.n_prompt = make_generator(r.seed), self._abort_epoch, n
            r.limit = min(r.req.sampling.max_new_tokens, self.max_context - n)
        ids = torch.tensor([[0] * (P - n) + list(r.req.prompt_ids) for r, n in zip(rows, lens)], device=self.device)
        mask = torch.tensor([[0] * (P - n) + [1] * n for n in lens], device=self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        want_routes = any(r.req.return_routed_experts for r in rows)
        self.routing.enabled = want_routes
        logits, cache = self._prefill(rows, ids, mask, pos, share=not want_routes)
        if want_routes:
            layers = self.routing.pop()  # [L] x [n * P, K]
            for b, (r, n) in enumerate(zip(rows, lens)):
                r.prompt_routes = torch.stack([layer.view(len(rows), P, -1)[b, P - n:] for layer in layers], dim=1)
        with self._version_lock:
            batch.join(rows, mask, pos, cache, logits)
            self._live = list(batch.rows)
        self.last_progress = time.monotonic()

    def _deliver(self, rows: List[Row], deliver) -> None:
        with self._version_lock:  # the spans are final once the rows leave the live set
            gone = {id(r) for r in rows}
            self._live = [r for r in self._live if id(r) not in gone]
            spans = [compute_spans(r.version_events, self.weight_version, len(r.tokens)) for r in rows]
        for r, sp in zip(rows, spans):
            self._aborted.discard(r.rid)
            deliver(r, r.to_sample(sp, self.config.logprob_mode))

    def _prefill(self, rows: List[Row], ids, mask, pos, share: bool):
        """The prompt forward of new rows: ``(last-position logits [n, V], KV cache of n rows)``.

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

    def _wait_if_paused(self, batch: DecodeBatch) -> None:
        """Hold the batch while paused. The lock is let go meanwhile so weight updates and version changes
        go through: tokens after ``continue`` then come from the new weights -- over the KV cache the old ones
        computed (``in_place``), or over a cache rebuilt with the new ones (``retract``, partial rollouts;
        ``pause.py``) -- and ``Sample.weight_versions`` says which version produced which tokens."""
        if self._unpaused.is_set():
            return
        epoch = min((r.epoch for r in batch.rows), default=self._abort_epoch)
        self._lock.release()  # held exactly once here: generate_stream is the only caller
        try:
            while not self._unpaused.wait(timeout=0.05):
                if self._abort_epoch != epoch or self._shut:
                    break
        finally:
            self._lock.acquire()
        self._require_live()
        if self._released and batch.rows:
            raise EngineUnavailableError("memory was released while generation was paused; the batch is lost")
        if self._pause_mode == "retract" and batch.rows:
            reprefill(self, batch)

    def _record_step(self, rows: List[Row], res) -> None:
        self.last_progress = time.monotonic()
        tokens, logprobs = res.tokens.tolist(), res.logprobs.tolist()  # one conversion, not one per row
        processed, support = res.processed.tolist(), res.support.tolist()
        top_ids = top_values = None
        if res.top_ids is not None:  # to the host once per step; rows keep host slices of it
            top_ids, top_values = res.top_ids.cpu(), res.top_values.cpu()
        cap = self.config.sampling_mask_max_tokens
        for b, r in enumerate(rows):
            if r.finish:
                continue
            if self._abort_epoch != r.epoch or r.rid in self._aborted:
                r.finish = "abort"
                continue
            if r.processed is not None and support[b] > cap:  # SGLang aborts the request (status OVERFLOW)
                r.finish = "abort"
                r.abort_message = (f"{SAMPLING_MASK_OVERFLOW}{cap}, commonly because "
                                   "of cutoff ties. Lower top_k to leave more headroom or increase the server limit.")
                continue
            tok = tokens[b]
            with self._version_lock:
                r.tokens.append(tok)
            r.logprobs.append(logprobs[b])
            if r.processed is not None:
                r.processed.append(processed[b])
            if top_ids is not None and r.req.return_top_logprobs:
                r.top_ids.append(top_ids[b, : r.req.return_top_logprobs])
                r.top_values.append(top_values[b, : r.req.return_top_logprobs])
            sp = r.req.sampling
            if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos_ids):
                r.finish, r.matched = "stop", tok
            elif len(r.tokens) >= r.limit:
                r.finish = "length"
