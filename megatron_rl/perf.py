"""Throughput and model-FLOPs utilisation (MFU) of an RL step.

Per step (:func:`step_metrics`, from the step's ``time/*`` and token metrics):

* ``perf/tokens_per_s_per_gpu``: NeMo-RL's definition -- every token of the step's training batch
  (prompt + response of each trained sequence) / (``time/step`` x all devices of the run, trainer and
  engine; colocated engines share the trainers' devices). On CPU a "device" is a trainer or engine process.
* ``perf/{rollout,train}_tokens_per_s_per_gpu``: generated tokens / (rollout time x engine devices);
  trained tokens / (train time x trainer devices). (``perf/*_tokens_per_s`` of :mod:`megatron_rl.metrics`
  are the same without the device count.)
* ``perf/trainer_idle_frac``, ``perf/engine_idle_frac``: 1 - busy / step time, where trainers are busy in
  the log-prob, train, diagnostics, weight-sync and checkpoint phases, and engines while a generation
  request of the driver is in flight and not paused (measured by the driver, ``orchestration/activity.py``:
  one-step and async rollouts overlap training), else in the rollout, weight-sync and evaluation phases.
* ``perf/mfu``: model FLOPs of the step / (``time/step`` x all devices x device peak); model FLOPs are
  :class:`ModelFlops` forward FLOPs times 3 for the trained batch (forward + backward), times the number
  of forward-only passes for the log-prob passes (reference-model passes counted with the policy's
  architecture), plus one forward over every generated sequence (prompt + response). Recomputation (the
  fused head's backward, activation checkpointing) is not model FLOPs. ``perf/{train,rollout}_mfu``: the
  phase's FLOPs over its own time and devices.

The device peak (:func:`device_peak_flops`): the vendor's dense bf16 (fp32 models: TF32) tensor-core
peak from a table of known GPUs; for other devices, and on CPU, a matmul rate: from a calibration file when
it has this device (``python -m megatron_rl.perf --calibrate`` on an idle machine writes one:
``$MEGATRON_RL_PEAK_FILE``, default ``~/.cache/megatron_rl/peak_flops.json``; source "calibrated"), else
measured once per process at start-up (the median of 5 timings of 0.2 s; trainer rank 0 reports it with
its set-up; source "measured") and cached for the process's lifetime. A start-up measurement follows the
machine's load (0.02-0.08 TFLOP/s on one busy 2-core machine), so MFU is comparable between runs only
with a calibration file. The run log says which source was used.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence

import torch

# Dense (no sparsity) tensor-core peaks, TFLOP/s: (name substring, bf16/fp16, tf32), vendor datasheets
# (SXM parts). First match wins: more specific names first.
GPU_PEAK_TFLOPS = (
    ("GH200", 989.0, 494.0),
    ("H200", 989.0, 494.0),
    ("H100 PCIe", 756.0, 378.0),
    ("H100", 989.0, 494.0),
    ("H800", 989.0, 494.0),
    ("H20", 148.0, 74.0),
    ("B200", 2250.0, 1100.0),
    ("B100", 1750.0, 875.0),
    ("A100", 312.0, 156.0),
    ("A800", 312.0, 156.0),
    ("L40S", 362.0, 183.0),
    ("A10G", 70.0, 35.0),
    ("RTX 4090", 165.0, 82.6),
)


@dataclass(frozen=True)
class ModelFlops:
    """Forward FLOPs of a decoder: ``2 x active matmul parameters`` per token plus causal attention,
    ``2 x layers x (heads x head_dim) x s^2`` per sequence of length ``s`` (QK^T and AV over the
    lower triangle). Active parameters: attention projections, the dense MLP or (MoE layers) the router
    and ``top-k`` experts, and the output layer; embeddings and norms are not matmuls."""

    linear_params: int
    layers: int
    attn_dim: int

    @classmethod
    def from_arch(cls, arch) -> "ModelFlops":
        h, q, kv = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        attn = h * q + 2 * h * kv + q * h
        dense_mlp = 3 * h * arch.ffn_hidden_size  # SwiGLU: gate, up, down
        moe_mlp = h * arch.num_experts + arch.moe_topk * 3 * h * arch.moe_ffn_hidden_size
        moe_layers = arch.moe_layers or (False,) * arch.num_layers
        per_layer = sum(attn + (moe_mlp if moe else dense_mlp) for moe in moe_layers)
        return cls(linear_params=per_layer + arch.vocab_size * h, layers=arch.num_layers, attn_dim=q)

    def forward(self, tokens: float, sum_sq_lengths: float) -> float:
        """Forward FLOPs over sequences with ``tokens`` tokens in all and ``sum_sq_lengths = sum s_i^2``."""
        return 2.0 * self.linear_params * tokens + 2.0 * self.layers * self.attn_dim * sum_sq_lengths


def sum_sq(lengths: Sequence[int]) -> float:
    return float(sum(int(n) ** 2 for n in lengths))


# ---- device peak -----------------------------------------------------------------------------------------
def gpu_table_peak(name: str, dtype: torch.dtype) -> Optional[float]:
    """FLOP/s of ``name`` (``torch.cuda.get_device_name()``) from :data:`GPU_PEAK_TFLOPS`, or None."""
    for key, bf16, tf32 in GPU_PEAK_TFLOPS:
        if key.lower() in name.lower():
            return 1e12 * (tf32 if dtype == torch.float32 else bf16)
    return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass

    return platform.processor() or platform.machine()


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, seconds: float = 1.0, rounds: int = 5) -> float:
    """Median of ``rounds`` timings of square matmuls (n = 1024 on CPU, 8192 on GPU) on this process's threads,
    ``seconds`` in all (the median: a busy neighbour slows one round, it does not set the result)."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.mm(a, b)
    sync()
    rates = []
    for _ in range(rounds):
        reps, start = 0, time.perf_counter()
        while True:
            torch.mm(a, b)
            reps += 1
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds / rounds:
                break
        rates.append(2.0 * n ** 3 * reps / elapsed)
    return statistics.median(rates)


def peak_file() -> str:
    return os.environ.get("MEGATRON_RL_PEAK_FILE") or os.path.expanduser("~/.cache/megatron_rl/peak_flops.json")


def _calibration_key(name: str, dtype: torch.dtype) -> str:
    return f"{name} | {str(dtype).replace('torch.', '')}"


def calibrated_peak(name: str, dtype: torch.dtype) -> Optional[float]:
    """The calibration file's FLOP/s for this device and dtype, or None."""
    try:
        with open(peak_file()) as f:
            value = json.load(f).get(_calibration_key(name, dtype))
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def calibrate(dtype: torch.dtype = torch.float32, seconds: float = 10.0) -> Dict[str, object]:
    """Measure this CPU's peak (``seconds`` long, median of 10 rounds) and store it in :func:`peak_file`."""
    name = f"{_cpu_name()} x{torch.get_num_threads()} threads"
    flops = measure_matmul_flops(torch.device("cpu"), dtype, seconds=seconds, rounds=10)
    path = peak_file()
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        table = {}
    table[_calibration_key(name, dtype)] = flops
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(table, f, indent=2)
    return {"device": name, "peak_flops": flops, "file": path}


def device_peak_flops(dtype: torch.dtype = torch.bfloat16, device: Optional[torch.device] = None) -> Dict[str, object]:
    """``{"device": name, "peak_flops": FLOP/s, "source": "table" | "measured"}`` of this process's device
    (CUDA if available, else CPU with this process's thread count)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_table_peak(name, dtype)
        if peak is not None:
            return {"device": name, "peak_flops": peak, "source": "table"}
    else:
        name = f"{_cpu_name()} x{torch.get_num_threads()} threads"
        dtype = torch.float32 if dtype not in (torch.float32, torch.float64) else dtype  # CPU runs fp32 models
        peak = calibrated_peak(name, dtype)
        if peak is not None:
            return {"device": name, "peak_flops": peak, "source": f"calibrated: {peak_file()}"}
    return {"device": name, "peak_flops": _measured(str(device), dtype, torch.get_num_threads()),
            "source": "measured at start-up, median of 5 x 0.2 s"}


@functools.lru_cache(maxsize=None)
def _measured(device: str, dtype: torch.dtype, threads: int) -> float:
    return measure_matmul_flops(torch.device(device), dtype)


# ---- devices and per-step figures ----------------------------------------------------------------------
@dataclass(frozen=True)
class Devices:
    trainer: int
    engine: int
    colocated: bool

    @property
    def total(self) -> int:
        return max(self.trainer, self.engine) if self.colocated else self.trainer + self.engine


def run_devices(cfg) -> Devices:
    """Devices of a :class:`~megatron_rl.config.RunConfig`: trainer processes, and engine servers times
    their GPUs each (SGLang ``tp_size``; one for an embedded engine); remote servers count as ``urls``."""
    r = cfg.rollout
    per_engine = r.sglang.tp_size if r.engine in ("sglang", "remote") else 1
    engines = (len(r.urls) if r.engine == "remote" else r.num_engines) * per_engine
    return Devices(cfg.parallel.world_size, engines, r.placement == "colocated" and r.engine != "remote")


TRAINER_PHASES = ("logprobs", "train", "diagnostics", "weight_sync", "checkpoint")
ENGINE_PHASES = ("rollout", "weight_sync", "eval")


def step_metrics(m: Mapping[str, float], flops: Optional[ModelFlops], devices: Devices,
                 peak_flops: Optional[float], engine_busy_s: Optional[float] = None) -> Dict[str, float]:
    """The ``perf/*`` figures of one step's metrics ``m`` (see the module docstring). ``engine_busy_s``: the
    engines' busy time as measured (``orchestration/activity.py``); None: their phases' time."""
    out: Dict[str, float] = {}
    step = m.get("time/step", 0.0)
    if step <= 0:
        return out

    def per(value: float, seconds: float, n: int) -> Optional[float]:
        return value / (seconds * n) if seconds > 0 and n > 0 else None

    figures = {
        "perf/tokens_per_s_per_gpu": per(m.get("train/tokens", 0.0), step, devices.total),
        "perf/train_tokens_per_s_per_gpu": per(m.get("train/tokens", 0.0), m.get("time/train", 0.0), devices.trainer),
        "perf/rollout_tokens_per_s_per_gpu": per(m.get("rollout/response_tokens", 0.0), m.get("time/rollout", 0.0),
                                                 devices.engine),
    }
    trainer_busy = sum(m.get(f"time/{p}", 0.0) for p in TRAINER_PHASES)
    if engine_busy_s is None:
        engine_busy_s = sum(m.get(f"time/{p}", 0.0) for p in ENGINE_PHASES)
    for busy, key in ((trainer_busy, "perf/trainer_idle_frac"), (engine_busy_s, "perf/engine_idle_frac")):
        figures[key] = min(1.0, max(0.0, 1.0 - busy / step))
    if flops is not None:
        rollout = 0.0
        if "rollout/seq_len_sq_sum" in m:
            tokens = m.get("rollout/prompt_tokens", 0.0) + m.get("rollout/response_tokens", 0.0)
            rollout = flops.forward(tokens, m["rollout/seq_len_sq_sum"])
        # the trainer's passes: perf/train_flops, perf/logprob_flops, perf/diagnostics_flops, ...
        trainer = sum(v for k, v in m.items() if k.startswith("perf/") and k.endswith("_flops"))
        figures["perf/model_tflop"] = (rollout + trainer) / 1e12
        if peak_flops:
            figures["perf/mfu"] = per(rollout + trainer, step * peak_flops, devices.total)
            figures["perf/train_mfu"] = per(m.get("perf/train_flops", 0.0), m.get("time/train", 0.0) * peak_flops,
                                            devices.trainer)
            figures["perf/rollout_mfu"] = per(rollout, m.get("time/rollout", 0.0) * peak_flops, devices.engine)
    out.update({k: float(v) for k, v in figures.items() if v is not None and math.isfinite(v)})
    return out


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Calibrate this CPU's matmul peak for MFU (run on an idle machine, "
                                 "with the OMP_NUM_THREADS the trainer ranks use)")
    ap.add_argument("--calibrate", action="store_true", required=True)
    ap.add_argument("--seconds", type=float, default=10.0)
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    r = calibrate(seconds=a.seconds)
    print(f"{r['device']}: {r['peak_flops'] / 1e12:.3f} TFLOP/s fp32 -> {r['file']}")
