"""One rollout engine as a Ray actor: it runs an SGLang-protocol server as a child process and manages it.

* ``embedded``: ``python -m megatron_rl.rollout.embedded.server`` -- our SGLang-compatible HTTP server over an
  :class:`~megatron_rl.rollout.embedded.EmbeddedEngine` (transformers). On CPU this is what makes the
  driver's SGLang client path -- HTTP generate, weight updates, memory release -- run for real over loopback.
* ``sglang``: ``python -m sglang.launch_server`` on the GPUs Ray gave this actor (``CUDA_VISIBLE_DEVICES``).

Both are a :class:`~megatron_rl.rollout.client.process.ManagedServer` in their own session, logging to
``<output_dir>/<kind>_<index>.log``: the actor can see the server's exit status, SIGKILL it (what a crash
looks like, also for tests) and launch it again, while it stays the engine's Ray handle -- engine recovery
(``engine_health.py``) restarts a dead or hung server through :meth:`EngineWorker.restart`, which launches
on a fresh port, so nothing that knows the old address reaches the new server before it has its weights.

The embedded server used to run inside this actor's process; as a child it costs one more interpreter
start (measured in the engine-recovery report: about the same start-up, ~no memory difference since the
actor itself then imports no torch) and buys a server that can die and come back without the actor.

Colocated, an SGLang server runs on the GPUs of the trainer ranks beside its TP ranks, which the driver
passes to :meth:`EngineWorker.start`.

The driver never talks to the actor for rollouts: it talks HTTP to the URL (one protocol for every
engine kind, and for ``rollout.engine: remote`` servers nobody here started).
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Optional

import ray
import torch

from megatron_rl.config import SGLangConfig
from megatron_rl.rollout.client.process import launch_embedded_server
from megatron_rl.rollout.client.proc_state import STOPPED
from megatron_rl.rollout.client.sglang import SGLangServerConfig, launch_sglang_server


STOPPED_GRACE_S = 1.0  # seen stopped at two polls this far apart: judged stopped


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
    log_dir: Optional[str] = None  # None: a fresh temporary directory
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    launch_timeout_s: float = 300.0  # embedded: interpreter + model load (SGLang: sglang.health_timeout_s)
    profile_dir: Optional[str] = None  # embedded: the folder its /start_profile may write in (the run's profiles)

    def sglang_server(self, log_path: Optional[str] = None, devices: Optional[str] = None):
        """The ``sglang.launch_server`` configuration of this engine (``devices``: its CUDA_VISIBLE_DEVICES)."""
        s = self.sglang
        return SGLangServerConfig(
            model_path=self.model_path, tp_size=s.tp_size, mem_fraction_static=s.mem_fraction_static,
            host=self.host, dtype=s.dtype, random_seed=self.seed, enable_return_routed_experts=self.routed_experts,
            enable_memory_saver=s.enable_memory_saver, sampling_backend=s.sampling_backend,
            enable_deterministic_inference=self.deterministic,
            extra_args=tuple(s.extra_args), health_timeout_s=s.health_timeout_s, log_path=log_path,
            env=dict(s.env, **({"CUDA_VISIBLE_DEVICES": devices} if devices else {})))


class EngineWorker:
    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.process = None  # the ManagedServer
        self.devices: Optional[str] = None
        self._stopped_since: Optional[float] = None  # when the server was first seen stopped (exit_status)

    def start(self, cuda_visible_devices: Optional[str] = None) -> str:
        """Start the server; returns its URL (reachable from the driver and the trainers).
        ``cuda_visible_devices``: SGLang's GPUs when they are not (all) this actor's (colocated TP > 1)."""
        spec = self.spec
        self.devices = cuda_visible_devices  # kept for restarts
        if spec.kind == "embedded":
            self.process = self._launch_embedded()
        elif spec.kind == "sglang":
            self.process = self._launch_sglang()
        else:
            raise ValueError(f"engine kind {spec.kind!r}: expected 'embedded' or 'sglang'")
        return self._advertised(self.process.url)

    def _advertised(self, url: str) -> str:
        if self.spec.host != "0.0.0.0":
            return url

        return url.replace("0.0.0.0", ray.util.get_node_ip_address())

    @property
    def log_path(self) -> str:
        if self.spec.log_dir is None:
            import tempfile

            self.spec.log_dir = tempfile.mkdtemp(prefix="megatron_rl_engine_")
        return os.path.join(self.spec.log_dir, f"{self.spec.kind}_{self.spec.index}.log")

    def _launch_embedded(self):
        spec = self.spec
        device = "cuda" if os.environ.get("CUDA_VISIBLE_DEVICES") and _cuda_available() else "cpu"
        return launch_embedded_server(
            spec.model_path, self.log_path, host=spec.host, seed=spec.seed, deterministic=spec.deterministic,
            health_timeout_s=spec.launch_timeout_s, env={"OMP_NUM_THREADS": str(spec.threads)},
            extra_args=["--max-batch-rows", "256", "--dtype", spec.dtype, "--device", device,
                        *(["--profile-dir", spec.profile_dir] if spec.profile_dir else [])])

    def _launch_sglang(self):
        return launch_sglang_server(self.spec.sglang_server(self.log_path, self.devices))

    # ---- recovery (engine_health.py) ----------------------------------------------------------------

    def exit_status(self) -> Optional[str]:
        """None while the server process runs; else how it ended (``exited with code -9 (SIGKILL)``), or
        :data:`STOPPED` ... once its processes have stayed stopped (SIGSTOP) for ``STOPPED_GRACE_S`` (a stopped
        server answers nothing, whether the driver holds the engines or not)."""
        proc = self.process.proc if self.process is not None else None
        if proc is None:
            return "was never started"
        code = proc.poll()
        if code is None:
            return self._stopped_status()
        if code < 0:
            try:
                return f"exited with code {code} ({signal.Signals(-code).name})"
            except ValueError:
                pass
        return f"exited with code {code}"

    def _stopped_status(self) -> Optional[str]:
        pids = self.process.stopped()
        if not pids:
            self._stopped_since = None
            return None
        now = time.monotonic()
        since = self._stopped_since = self._stopped_since or now
        if now - since < STOPPED_GRACE_S:
            return None  # seen once: it may be a SIGSTOP + SIGCONT pair (job control)
        return f"{STOPPED} (state T, pids {pids}) for {now - since:.0f} s"

    def kill(self) -> None:
        """SIGKILL the server and its workers (what a crash looks like)."""
        if self.process is not None:
            self.process.kill()

    def restart(self) -> str:
        """SIGKILL what is left of the server and launch it again, on a fresh port; returns the new URL once
        ``/health`` passes (``ServerLaunchError`` with the log tail if it does not)."""
        self.kill()
        return self.start(self.devices)

    # ---- profiling (profile.steps) ---------------------------------------------------------------------

    def start_profile(self, path: str, record_shapes: bool = False, with_stack: bool = False) -> None:
        """The server's ``/start_profile`` writing into the directory ``path`` (SGLang's traces, or the embedded
        server's one Chrome trace of its process)."""
        self._post("/start_profile", {"output_dir": path, "record_shapes": record_shapes, "with_stack": with_stack})

    def stop_profile(self) -> None:
        self._post("/stop_profile", {})

    def _post(self, path: str, body: dict) -> None:
        req = urllib.request.Request(self.process.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None

    def log_tail(self, lines: int = 40) -> str:
        if self.process is None:
            return "(never started)"
        return f"last lines of {self.process.log_path}:\n{self.process.log_tail(lines)}"


def _cuda_available() -> bool:
    return torch.cuda.is_available()
