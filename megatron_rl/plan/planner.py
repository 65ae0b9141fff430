"""Candidates, ranking and the printed plan.

Candidates for ``N`` devices (every one uses at most ``N``: a plan may leave devices idle, so more devices are
never predicted slower): trainer layouts TP in {1, 2, 4, 8} (within a node), PP dividing the layers, EP dividing
the experts (MoE), DP what remains; engines of TP in {1, 2, 4, 8}; colocated (trainers and engines on all the
devices) or disaggregated with an engine:trainer split of 1:3, 1:1 or 3:1 of the devices; modes sync, one-step and
async k in {1, 2} (overlapped modes disaggregated only); on CPU engines are single processes (no engine TP). Every candidate runs the same batch, so the ranking is by
predicted step time (fewer devices break ties); candidates that do not fit the device memory are left out.
"""

from __future__ import annotations

import os
from typing import Iterable, List

from megatron_rl.bench.workload import Workload
from megatron_rl.plan.cost_model import Efficiency, Layout, ModelShape, PlanWorkload, Prediction, predict
from megatron_rl.plan.devices import Device

POW2 = (1, 2, 4, 8)


def load_shape(model_config: str, bytes_per_param: int = 2) -> ModelShape:
    """``model_config``: an HF directory or a ``config.json``."""
    from transformers import AutoConfig

    from megatron_rl.bench.model import read_config
    from megatron_rl.models.config import HFArch

    if os.path.isdir(model_config):
        hf = AutoConfig.from_pretrained(model_config)
    else:
        raw = read_config(model_config)
        hf = AutoConfig.for_model(**raw)
    return ModelShape.from_arch(HFArch.from_hf(hf), bytes_per_param)


def _splits(n: int) -> List[int]:
    """Engine device counts of the disaggregated candidates for n devices."""
    return sorted({e for e in (n // 4, n // 2, (3 * n) // 4) if 0 < e < n})


def candidates(n_devices: int, shape: ModelShape, dev: Device) -> Iterable[Layout]:
    for n in range(1, n_devices + 1):
        for placement, engine_devs in [("colocated", n)] + [("disaggregated", e) for e in _splits(n)]:
            trainers = n if placement == "colocated" else n - engine_devs
            for tp in POW2:
                for pp in (1, 2, 4):
                    if tp > dev.per_node or trainers % (tp * pp) or shape.layers % pp:
                        continue
                    for ep in (POW2 if shape.num_experts else (1,)):
                        if ep > 1 and (shape.num_experts % ep or (trainers // (tp * pp)) % ep):
                            continue
                        for etp in (POW2 if not dev.cores else (1,)):  # CPU engines (embedded) have no TP
                            if engine_devs % etp or etp > dev.per_node:
                                continue
                            modes = [("sync", 1)] + ([("one_step", 1), ("async", 1), ("async", 2)]
                                                     if placement == "disaggregated" else [])
                            for mode, k in modes:
                                yield Layout(tp, pp, ep, trainers, engine_devs // etp, etp, placement, mode, k)


def rank(shape: ModelShape, work: PlanWorkload, dev: Device, eff: Efficiency, n_devices: int,
         only_n: bool = False) -> List[Prediction]:
    """Predictions, best first (highest tokens/s over all ``n_devices``: step time decides, fewer used devices
    break ties); ``only_n``: only candidates that use every device."""
    preds = [predict(shape, work, lay, dev, eff) for lay in candidates(n_devices, shape, dev)
             if not only_n or lay.devices == n_devices]
    fitting = [p for p in preds if p.fits]
    return sorted(fitting, key=lambda p: (p.step_s, p.layout.devices, p.layout.describe()))


def plan_workload(prompts: int, samples: int, workload: Workload, train_mb_tokens: int = 16384,
                  forward_mb_tokens: int = 0) -> PlanWorkload:
    return PlanWorkload(prompts, samples, workload.prompt, workload.response, train_mb_tokens, forward_mb_tokens)


def format_plan(preds: List[Prediction], shape: ModelShape, work: PlanWorkload, dev: Device, eff: Efficiency,
                n_devices: int, top: int = 10) -> str:
    lines = [f"## plan: {n_devices} x {dev.name}, {shape.params / 1e9:.3g} B parameters "
             f"({shape.active / 1e9:.3g} B active matmul), {work.prompts} prompts x {work.samples} samples, "
             f"prompt {work.prompt.describe()}, response {work.response.describe()}", "",
             "| rank | layout | devices | step s | rollout s | trainer s | sync s | other s | overlap saved s | "
             "tokens/s/GPU | MFU % |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for i, p in enumerate(preds[:top], 1):
        ph = p.phases
        tps = p.tokens_per_s_per_gpu * p.layout.devices / n_devices
        lines.append(f"| {i} | {p.layout.describe()} | {p.layout.devices} | {p.step_s:.3f} | {ph['rollout']:.3f} | "
                     f"{ph['trainer']:.3f} | {ph['weight_sync']:.3f} | {ph['other']:.3f} | "
                     f"{ph['overlap_saved']:.3f} | {tps:.1f} | {100 * p.mfu:.1f} |")
    if not preds:
        lines.append("| - | no candidate fits the device memory | | | | | | | | | |")
    lines += ["", "assumptions:",
              f"* device {dev.name}: {dev.peak_flops / 1e12:.4g} TFLOP/s peak, {dev.hbm_bytes_per_s / 1e9:.0f} GB/s "
              f"memory, links {dev.intra_gb_per_s:g} GB/s in a node / {dev.inter_gb_per_s:g} GB/s between nodes, "
              f"{dev.memory_gib:g} GiB, {dev.per_node} per node, collectives {1e6 * dev.collective_latency_s:g} us"
              + (f", {dev.cores} shared cores ({dev.background_cores:g} kept busy by the driver and Ray)"
                 if dev.cores else "")
              + f" ({dev.source})",
              f"* efficiencies ({eff.source}): trainer base MFU {100 * eff.base_mfu:.2f}% (x 0.92 per TP doubling, "
              f"x the PP bubble), {eff.trainer_passes:.2f} trainer passes per forward ({eff.forward_passes:.2f} "
              f"forward-only), host overhead {1e3 * eff.fwd_layer_s:.3f} / {1e3 * eff.train_layer_s:.3f} ms per layer "
              f"and forward / train micro-batch ({work.train_mb_tokens or work.micro_batch_size} "
              f"{'tokens' if work.train_mb_tokens else 'sequences'} a train micro-batch), decode at "
              f"{100 * eff.decode_bw_eff:.0f}% of memory bandwidth and {100 * eff.decode_flop_eff:.0f}% of peak FLOPs, "
              f"rollout x{eff.rollout_scale:.3g}, weight sync overhead {eff.sync_overhead_s:.3f} s, other "
              f"{1e3 * eff.other_per_seq_s:.3f} ms/sequence, colocated hand-over {eff.handoff_s:.3f} s",
              "* tokens/s/GPU over all the devices asked for (idle ones count); MFU over the devices used",
              "* the cost model: megatron_rl/plan/cost_model.py (docstring)"]
    return "\n".join(lines) + "\n"


def layout_of(cfg) -> Layout:
    """The :class:`Layout` of a run config (what a bench ran)."""
    r, p = cfg.rollout, cfg.parallel
    etp = r.sglang.tp_size if r.engine in ("sglang", "remote") else 1
    return Layout(p.tp, p.pp, p.ep, p.world_size, r.num_engines, etp, r.placement, r.mode, r.max_staleness)


def workload_of(cfg, workload: Workload) -> PlanWorkload:
    t = cfg.train
    return PlanWorkload(cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt, workload.prompt,
                        workload.response, t.max_tokens_per_micro_batch, t.forward_max_tokens_per_micro_batch,
                        t.micro_batch_size)
