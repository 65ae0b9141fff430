"""Launch SGLang servers (GPU) from a typed config; talk to them with ``http_client.SGLangClient``.

``sglang`` itself is never imported here (it pulls a CUDA torch and kernels): the server runs as
``python -m sglang.launch_server`` in a child process, and we only check that the package is installed,
at the pinned version, when the launch uses this interpreter.

Flags worth knowing for RL (all in ``SGLangServerConfig``):
* ``enable_return_routed_experts`` -> ``--enable-return-routed-experts`` (MoE routing replay);
* ``enable_memory_saver`` -> ``--enable-memory-saver``, needed for ``/release_memory_occupation`` in
  colocated mode;
* ``enable_deterministic_inference`` -> ``--enable-deterministic-inference``: without it SGLang ignores
  ``sampling_seed`` whatever the sampling backend (``srt/sampling/sampling_batch_info.py``), so seeded,
  reproducible rollouts need it (it also refuses ``min_p > 0`` and costs some speed: batch-invariant kernels).
Log-prob convention of SGLang's ``output_token_logprobs``: see ``protocol.py`` ("raw").
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from megatron_rl.rollout.client.process import ManagedServer, free_port

SGLANG_VERSION = "0.5.23"  # the version this module's flags and wire format were written against


@dataclass
class SGLangServerConfig:
    model_path: str
    tp_size: int = 1
    mem_fraction_static: float = 0.8
    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port at launch (kept across restarts)
    base_gpu_id: int = 0
    dtype: str = "auto"
    random_seed: Optional[int] = None
    skip_tokenizer_init: bool = True  # we send token ids and read token ids back
    enable_return_routed_experts: bool = False
    enable_memory_saver: bool = False
    sampling_backend: Optional[str] = None  # None = SGLang's choice
    enable_deterministic_inference: bool = False  # honour sampling_seed (see the module doc)
    extra_args: Tuple[str, ...] = ()
    env: Dict[str, str] = field(default_factory=dict)
    python_executable: str = sys.executable
    log_path: Optional[str] = None  # None: a file under the temp directory
    health_timeout_s: float = 900.0  # model load + CUDA graph capture can take minutes

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"SGLangServerConfig.tp_size={self.tp_size}: expected >= 1")
        if not (0.0 < self.mem_fraction_static < 1.0):
            raise ValueError(f"SGLangServerConfig.mem_fraction_static={self.mem_fraction_static}: expected in (0, 1)")
        if not (0 <= self.port < 65536):
            raise ValueError(f"SGLangServerConfig.port={self.port}: expected 0 (free port) or a port number")
        if self.sampling_backend not in (None, "pytorch", "flashinfer"):
            raise ValueError(f"SGLangServerConfig.sampling_backend={self.sampling_backend!r}: "
                             "expected None, 'pytorch' or 'flashinfer'")

    def argv(self, port: int) -> List[str]:
        args = [self.python_executable, "-m", "sglang.launch_server", "--model-path", self.model_path,
                "--host", self.host, "--port", str(port), "--tp-size", str(self.tp_size),
                "--mem-fraction-static", str(self.mem_fraction_static), "--base-gpu-id", str(self.base_gpu_id),
                "--dtype", self.dtype]
        if self.random_seed is not None:
            args += ["--random-seed", str(self.random_seed)]
        if self.skip_tokenizer_init:
            args.append("--skip-tokenizer-init")
        if self.enable_return_routed_experts:
            args.append("--enable-return-routed-experts")
        if self.enable_memory_saver:
            args.append("--enable-memory-saver")
        if self.sampling_backend:
            args += ["--sampling-backend", self.sampling_backend]
        if self.enable_deterministic_inference:
            args.append("--enable-deterministic-inference")
        return args + list(self.extra_args)


def check_sglang_installed() -> str:
    """The installed SGLang version; ImportError with the install command if it is missing."""
    if importlib.util.find_spec("sglang") is None:
        raise ImportError(f"sglang is not installed in {sys.executable}. It needs a CUDA GPU: "
                          f"`pip install sglang=={SGLANG_VERSION}` (or the 'gpu' extra of megatron_rl). "
                          "Without a GPU use the embedded engine (megatron_rl.rollout.embedded.engine).")
    version = importlib.metadata.version("sglang")
    if version != SGLANG_VERSION:
        warnings.warn(f"sglang {version} is installed; megatron_rl is written against {SGLANG_VERSION} "
                      "(endpoint fields and log-prob conventions may differ)", stacklevel=2)
    return version


def launch_sglang_server(config: SGLangServerConfig, check_installed: bool = True) -> ManagedServer:
    """Start SGLang and wait for ``/health``; raises ``ServerLaunchError`` with its log tail on failure.
    ``check_installed`` (only meaningful when it runs on this interpreter) fails fast before spawning."""
    if check_installed and config.python_executable == sys.executable:
        check_sglang_installed()
    port = config.port or free_port(config.host)
    log_path = config.log_path or os.path.join(tempfile.gettempdir(), f"sglang_{config.host}_{port}.log")
    env = dict(os.environ, **config.env)
    server = ManagedServer(config.argv(port), f"http://{config.host}:{port}", log_path, env=env,
                           health_timeout_s=config.health_timeout_s, name=f"SGLang ({config.model_path})")
    return server.start()
