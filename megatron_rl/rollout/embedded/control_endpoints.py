"""The embedded server's control endpoints, as SGLang 0.5.23 serves them: cache flush, profiling, memory
release/resume, pause/continue, abort, weight version (mixed into
:class:`~megatron_rl.rollout.embedded.server.EmbeddedServer`, whose state they use: engine, queue, tags)."""

from __future__ import annotations

import os
from typing import List

from megatron_rl.profiling import Capture
from megatron_rl.rollout.embedded import guards
from megatron_rl.rollout.embedded.http_handler import body_field, request_error, validation_error
from megatron_rl.rollout.embedded.pause import PAUSE_MODES
from megatron_rl.rollout.embedded.scheduler_rules import check_release, check_resume, fully_idle


class ControlEndpoints:
    """``/flush_cache``, ``/start_profile``, ``/stop_profile``, ``/release_memory_occupation``,
    ``/resume_memory_occupation``, ``/pause_generation``, ``/continue_generation``, ``/abort_request``,
    ``/update_weight_version``."""

    def _flush_cache(self, body):
        if not fully_idle(self.queue, self.engine):
            return 400, "Flush cache failed.\n"
        return 200, ("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                     "waiting requests, the operation will not be performed.)\n")

    def _start_profile(self, body):
        """SGLang's ``ProfileReq`` fields we honour: ``output_dir`` (inside ``--profile-dir``, whose default is
        SGLang's: $SGLANG_TORCH_PROFILER_DIR, else /tmp), ``record_shapes``, ``with_stack``; one Chrome trace of
        this process, every thread."""
        body = body or {}
        try:  # only inside the server's profile folder: a client must not choose where this process writes
            out = guards.profile_output_dir(body.get("output_dir"), self.profile_dir)
        except ValueError as e:
            raise request_error(str(e)) from None
        os.makedirs(out, exist_ok=True)
        self._capture = self._capture or Capture()
        self._capture.start(os.path.join(out, "embedded-TP-0.trace.json"), bool(body.get("record_shapes")),
                            bool(body.get("with_stack")))
        return 200, "Start profiling.\n"

    def _stop_profile(self, body):
        if self._capture is None:
            raise request_error("profiling is not in progress: call /start_profile first")
        self._capture.stop()
        return 200, "Stop profiling. This will take some time.\n"

    def _tags(self, body) -> List[str]:
        tags = body_field(body, "tags", list, None) or ["kv_cache", "weights", "cuda_graph"]
        unknown = [t for t in tags if t not in ("kv_cache", "weights", "cuda_graph")]
        if unknown:
            raise request_error(f"unknown memory tags {unknown}: expected 'kv_cache', 'weights', 'cuda_graph'")
        return tags

    def _release(self, body):
        tags = self._tags(body)
        check_release(self.queue, self.engine)
        self._released |= set(tags)
        self.engine.release_memory()
        return 200, None

    def _resume(self, body):
        tags = self._tags(body)
        check_resume(self._released, tags)
        self._released -= set(tags)
        if not self._released:
            self.engine.resume_memory()
        return 200, None

    def _pause(self, body):
        mode = body_field(body, "mode", str, "abort")
        if mode not in PAUSE_MODES:
            raise validation_error("mode", "Input should be 'abort', 'retract' or 'in_place'", mode)
        self.queue.pause()
        self.engine.pause("in_place" if mode == "abort" else mode)
        if mode == "abort":
            self.engine.abort(abort_all=True)
            self.queue.abort(None, abort_all=True)
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def _continue(self, body):
        self.engine.continue_generation()
        self.queue.resume()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def _abort(self, body):
        rid = body_field(body, "rid", str, None)
        abort_all = body_field(body, "abort_all", bool, False)
        self.engine.abort(rid or None, abort_all)
        self.queue.abort(rid or None, abort_all)
        return 200, None

    def _set_version(self, body):
        version = body_field(body, "new_version", str)
        try:
            guards.bounded_version(version, "new_version")
        except ValueError as e:
            raise request_error(str(e)) from None
        if body_field(body, "abort_all_requests", bool, True):
            self.engine.abort(abort_all=True)
            self.queue.abort(None, abort_all=True)
        self.engine.update_weight_version(version)
        return 200, {"success": True, "message": f"Weight version updated to {version}", "new_version": version}
