"""One rollout engine as a Ray actor that serves SGLang's HTTP protocol and returns its URL.

* ``embedded``: an :class:`~megatron_rl.rollout.embedded.EmbeddedEngine` (transformers) behind our
  SGLang-compatible :class:`~megatron_rl.rollout.server.EmbeddedServer`, in this actor's process
  (its HTTP and generation threads keep running between actor calls). On CPU this is what makes the
  driver's SGLang client path — HTTP generate, weight updates, memory release — run for real over
  loopback.
* ``sglang``: ``python -m sglang.launch_server`` as a managed child process on the GPUs Ray gave this
  actor (``CUDA_VISIBLE_DEVICES``), stopped with the actor.

The driver never talks to the actor for rollouts: it talks HTTP to the URL (one protocol for every
engine kind, and for ``rollout.engine: remote`` servers nobody here started).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from megatron_rl.config import SGLangConfig


@dataclass
class EngineSpec:
    kind: str  # "embedded" | "sglang"
    model_path: str
    index: int = 0
    deterministic: bool = True  # honour sampling_seed (SGLang: --enable-deterministic-inference)
    seed: int = 0
    host: str = "127.0.0.1"
    threads: int = 1
    routed_experts: bool = False
    dtype: str = "float32"  # embedded engine weights
    log_dir: str = "."
    sglang: SGLangConfig = field(default_factory=SGLangConfig)


class EngineWorker:
    def __init__(self, spec: EngineSpec):
        import torch
        from transformers.utils import logging as hf_logging

        torch.set_num_threads(spec.threads)
        hf_logging.disable_progress_bar()  # a weight-loading bar per engine, forwarded line by line by Ray
        self.spec = spec
        self.server = None
        self.process = None
        self.capture = None  # embedded: a torch-profiler session over this process (profile.steps)
        self._url = None

    def start(self) -> str:
        """Start the server; returns its URL (reachable from the driver and the trainers)."""
        spec = self.spec
        if spec.kind == "embedded":
            return self._start_embedded()
        if spec.kind == "sglang":
            return self._start_sglang()
        raise ValueError(f"engine kind {spec.kind!r}: expected 'embedded' or 'sglang'")

    def _advertised(self, url: str) -> str:
        if self.spec.host != "0.0.0.0":
            return url
        import ray

        return url.replace("0.0.0.0", ray.util.get_node_ip_address())

    def _start_embedded(self) -> str:
        import torch

        from megatron_rl.rollout.embedded import EmbeddedEngine, EmbeddedEngineConfig
        from megatron_rl.rollout.server import EmbeddedServer

        spec = self.spec
        device = "cuda" if torch.cuda.is_available() else "cpu"
        engine = EmbeddedEngine.from_pretrained(
            spec.model_path, EmbeddedEngineConfig(seed=spec.seed, max_batch_rows=256,
                                                  seeds="deterministic" if spec.deterministic else "ignored"),
            dtype=getattr(torch, spec.dtype), device=device)
        self.server = EmbeddedServer(engine, host=spec.host, port=0, model_path=spec.model_path).start()
        self._url = self.server.url
        return self._advertised(self.server.url)

    def _start_sglang(self) -> str:
        from megatron_rl.rollout.sglang import SGLangServerConfig, launch_sglang_server

        spec, s = self.spec, self.spec.sglang
        cfg = SGLangServerConfig(
            model_path=spec.model_path, tp_size=s.tp_size, mem_fraction_static=s.mem_fraction_static,
            host=spec.host, dtype=s.dtype, random_seed=spec.seed, enable_return_routed_experts=spec.routed_experts,
            enable_memory_saver=s.enable_memory_saver, sampling_backend=s.sampling_backend,
            enable_deterministic_inference=spec.deterministic,
            extra_args=tuple(s.extra_args), env=dict(s.env), health_timeout_s=s.health_timeout_s,
            log_path=os.path.join(spec.log_dir, f"sglang_{spec.index}.log"))
        self.process = launch_sglang_server(cfg)
        self._url = self.process.url
        return self._advertised(self.process.url)

    def start_profile(self, path: str, record_shapes: bool = False, with_stack: bool = False) -> None:
        """Embedded: trace this process (all threads) into ``path``.json; SGLang: its ``/start_profile``
        writing into the directory ``path``."""
        if self.process is not None:
            self._post("/start_profile", {"output_dir": path, "record_shapes": record_shapes,
                                          "with_stack": with_stack})
            return
        from megatron_rl.profiling import Capture

        self.capture = self.capture or Capture()
        self.capture.start(path + ".json", record_shapes, with_stack)

    def stop_profile(self) -> Optional[str]:
        if self.process is not None:
            self._post("/stop_profile", {})
            return None
        return None if self.capture is None else self.capture.stop()

    def _post(self, path: str, body: dict) -> None:
        import json
        import urllib.request

        req = urllib.request.Request(self._url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.process is not None:
            self.process.stop()
            self.process = None

    def log_tail(self) -> Optional[str]:
        return self.process.log_tail() if self.process is not None else None
