"""Device table: what the cost model assumes of a device, from vendor datasheets (SXM parts, dense bf16).

``cpu`` is this machine: its "devices" are processes (as ``perf`` counts them on CPU); the matmul peak of one
single-thread process comes from :func:`megatron_rl.perf.device_peak_flops` (calibrated or measured), and the
processes share ``cores`` physical cores, so phases that overlap in time cannot run faster than the cores allow.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float  # dense bf16 (CPU: fp32 matmul of one process) FLOP/s
    hbm_bytes_per_s: float  # memory bandwidth per device
    intra_gb_per_s: float  # per-device link inside a node (NVLink; CPU: shared memory)
    inter_gb_per_s: float  # per-device link between nodes (InfiniBand / RoCE NIC)
    memory_gib: float
    per_node: int  # devices per node (a TP group stays inside one node)
    collective_latency_s: float = 2e-5  # one small collective (NCCL over NVLink; CPU: gloo over loopback)
    cores: Optional[int] = None  # CPU only: physical cores all processes share
    background_cores: float = 0.0  # CPU only: cores the driver and Ray's processes keep busy
    source: str = "vendor datasheet"


VENDOR = {
    # H100 SXM: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 4 900 GB/s bidirectional, 400 Gb/s NIC per GPU
    "H100": Device("H100", 989e12, 3.35e12, 450.0, 50.0, 80.0, 8),
    # H200 SXM: same compute as H100, 4.8 TB/s HBM3e, 141 GB
    "H200": Device("H200", 989e12, 4.8e12, 450.0, 50.0, 141.0, 8),
    # B200: 2.25 PFLOP/s bf16 dense, 8 TB/s HBM3e, NVLink 5 1.8 TB/s bidirectional, 180 GB usable
    "B200": Device("B200", 2250e12, 8.0e12, 900.0, 50.0, 180.0, 8),
}
GPUS = tuple(VENDOR)


def cpu_device(cores: Optional[int] = None, peak_flops: Optional[float] = None) -> Device:
    """This CPU: one single-thread process per device; DRAM ~20 GB/s per process, shared-memory links ~5 GB/s;
    a gloo collective ~0.3 ms (2 processes, loopback: 0.23 ms all-reduce and 0.38 ms all-gather of 4 bytes, 1.2 /
    0.86 ms of 0.4 MB, measured on the 2-core machine); the driver, the heartbeat board and Ray's daemons keep
    ~0.5 core busy during a bench (their CPU time over a 36 s tiny bench: 0.46 core, psutil)."""
    if peak_flops is None:
        import torch

        from megatron_rl.perf import device_peak_flops

        torch.set_num_threads(1)
        info = device_peak_flops(torch.float32, torch.device("cpu"))
        peak_flops, source = float(info["peak_flops"]), f"{info['device']}: {info['source']}"
    else:
        source = "the calibration's"
    cores = cores or os.cpu_count() or 1
    return Device("cpu", peak_flops, 20e9, 5.0, 1.0, 8.0, 64, collective_latency_s=3e-4, cores=cores,
                  background_cores=0.5, source=source)


def device(name: str, cores: Optional[int] = None, peak_flops: Optional[float] = None) -> Device:
    key = name.upper() if name.lower() != "cpu" else "cpu"
    if key == "cpu":
        return cpu_device(cores, peak_flops)
    if key not in VENDOR:
        raise ValueError(f"--gpu={name!r}: unknown device; known: {', '.join(GPUS)}, cpu")
    d = VENDOR[key]
    return replace(d, peak_flops=peak_flops, source="the calibration's peak") if peak_flops else d
