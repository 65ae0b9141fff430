"""``calibration.json``: the cost model's efficiencies measured by one ``bench`` run (a ``sync`` run is best: its
phase times do not overlap), read by ``megatron-rl plan --calibration``.

From the bench's medians (the run's own metrics): the trainer's FLOPs (``perf/{train,logprob,diagnostics}_flops``)
over the batch's forward FLOPs give ``trainer_passes`` and ``forward_passes``; the forward-only phases (log-probs,
diagnostics) and the train phase, less their FLOPs at the prior MFU and their modelled communication, give the
host overheads ``fwd_layer_s`` and ``train_layer_s`` (per layer and micro-batch of one rank with a core to itself;
a run faster than the prior MFU allows gets a higher MFU and no overhead instead); the measured rollout time over
the model's roofline (default efficiencies) gives ``rollout_scale``; the sync time less its bytes over the link
gives ``sync_overhead_s``; the colocated memory hand-over is ``handoff_s``; the rest of the step per sequence is
``other_per_seq_s``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from megatron_rl.plan.cost_model import (Efficiency, Layout, ModelShape, PlanWorkload, core_share, rollout_seconds,
                                         sync_seconds, trainer_terms)
from megatron_rl.plan.devices import Device

HANDOFF_TIMES = ("engine_memory", "trainer_memory")


def calibrate(med: Mapping[str, float], shape: ModelShape, work: PlanWorkload, lay: Layout, dev: Device) -> Efficiency:
    """``med``: ``{metric: median}`` of a bench's timed steps."""
    prior = Efficiency()
    tokens = med.get("train/tokens", 0.0)
    fwd = shape.flops.forward(tokens, med.get("rollout/seq_len_sq_sum") or tokens ** 2 / work.sequences)
    fwd_flops = sum(med.get(f"perf/{p}_flops", 0.0) for p in ("logprob", "diagnostics"))
    trainer_flops = fwd_flops + med.get("perf/train_flops", 0.0)
    passes = trainer_flops / fwd if fwd and trainer_flops else prior.trainer_passes
    fwd_passes = fwd_flops / fwd if fwd and trainer_flops else prior.forward_passes
    no_overhead = Efficiency(trainer_passes=passes, forward_passes=fwd_passes, fwd_layer_s=0.0, train_layer_s=0.0)
    terms = trainer_terms(shape, work, lay, dev, no_overhead)
    fwd_flop_s = terms["flops"] * fwd_passes / passes
    fwd_s = sum(med.get(f"time/{p}", 0.0) for p in ("logprobs", "diagnostics"))
    train_s = med.get("time/train", 0.0)
    # the overheads: what the phases took beyond their FLOPs at the prior MFU and their communication
    unit = trainer_terms(shape, work, lay, dev, Efficiency(trainer_passes=0.0, forward_passes=fwd_passes,
                                                           fwd_layer_s=1.0, train_layer_s=1.0))
    fwd_rest = fwd_s - fwd_flop_s - terms["fwd_tp"]
    train_rest = train_s - (terms["flops"] - fwd_flop_s) - terms["train_tp"] - terms["dp"]
    mfu = prior.base_mfu
    if fwd_rest < 0 or train_rest < 0:  # faster than the prior MFU allows: a higher MFU, no overhead
        compute = fwd_s + train_s - terms["fwd_tp"] - terms["train_tp"] - terms["dp"]
        mfu = prior.base_mfu * terms["flops"] / compute if compute > 0 else prior.base_mfu
        fwd_rest = train_rest = 0.0
    fwd_layer = fwd_rest / unit["fwd_overhead"] if unit["fwd_overhead"] and fwd_s else prior.fwd_layer_s
    train_layer = train_rest / unit["train_overhead"] if unit["train_overhead"] and train_s else prior.train_layer_s
    roofline = rollout_seconds(shape, work, lay, dev, Efficiency())
    scale = med.get("time/rollout", 0.0) / roofline if roofline and med.get("time/rollout") else 1.0
    link = sync_seconds(shape, lay, dev, Efficiency(sync_overhead_s=0.0))
    sync_s = med.get("time/weight_sync", med.get("sync/seconds", 0.0))
    sync_overhead = max(0.0, sync_s - link) * core_share(lay.trainers, dev)
    handoff = sum(med.get(f"time/{p}", 0.0) for p in HANDOFF_TIMES)
    named = med.get("time/rollout", 0.0) + fwd_s + train_s + med.get("time/weight_sync", 0.0) + handoff
    other = max(0.0, med.get("time/step", 0.0) - named) / work.sequences
    return Efficiency(base_mfu=mfu, trainer_passes=passes, forward_passes=fwd_passes, fwd_layer_s=fwd_layer,
                      train_layer_s=train_layer, rollout_scale=scale, sync_overhead_s=sync_overhead,
                      other_per_seq_s=other, handoff_s=handoff, source="calibrated")


def save(path: str, eff: Efficiency, meta: Mapping[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump({"efficiency": dataclasses.asdict(eff), "meta": dict(meta)}, f, indent=2, default=str)


def load(path: str) -> Efficiency:
    try:
        with open(path) as f:
            raw = json.load(f)["efficiency"]
        known = {f.name for f in dataclasses.fields(Efficiency)}
        return Efficiency(**{k: v for k, v in raw.items() if k in known} | {"source": f"calibrated: {path}"})
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--calibration={path!r}: not a calibration.json written by `megatron-rl bench` ({e}); "
                         "run a bench first or leave --calibration out for the defaults") from None


def measured_peak(path: str, device: str) -> "float | None":
    """The device peak a calibration was computed with, when it was this device kind's (its efficiencies are
    relative to that peak: on CPU a re-measured peak would follow the machine's load instead)."""
    try:
        with open(path) as f:
            meta = json.load(f).get("meta", {})
    except (OSError, ValueError):
        return None
    return float(meta["peak_flops"]) if meta.get("device") == device and meta.get("peak_flops") else None


def write_for_bench(spec, cfg, result: Mapping[str, Any]) -> "str | None":
    """A bench point's ``calibration.json`` (``megatron_rl.bench.sweep.run_point``'s ``after``): the efficiencies
    of its medians on this machine's device (a known GPU, else the CPU, at the peak measured now). Only a
    ``--mode full`` bench calibrates: the cost model's phases are those of the whole step."""
    if spec.mode != "full":
        return None
    import torch

    from megatron_rl.plan import devices, planner

    med = {k: v["median"] for k, v in result["stats"].items()}
    shape = planner.load_shape(cfg.model.hf_path, 4 if cfg.model.dtype == "float32" else 2)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    gpu = next((g for g in devices.GPUS if g.lower() in name.lower()), None)
    dev = devices.device(gpu or "cpu")
    eff = calibrate(med, shape, planner.workload_of(cfg, spec.workload), planner.layout_of(cfg), dev)
    path = os.path.join(spec.folder, "calibration.json")
    save(path, eff, {**result.get("meta", {}), "device": dev.name, "peak_flops": dev.peak_flops,
                     "layout": planner.layout_of(cfg).describe()})
    return path
