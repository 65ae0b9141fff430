"""The cost model of one RL step (every assumption here is printed by ``megatron-rl plan``).

With ``N = prompts x samples`` sequences of prompt length ``p`` and response length ``r`` (expectations over the
workload's distributions; ``E[(p+r)^2]`` for attention):

* trainer (log-probs + train + diagnostics), per rank: the FLOPs, ``k x F_fwd / (trainer devices x peak x MFU x
  0.92^log2(tp) x m / (m + pp - 1))`` (``F_fwd``: :class:`megatron_rl.perf.ModelFlops` forward FLOPs of the batch;
  ``k`` the passes, 3 for forward + backward, +1 per forward-only pass, calibrated from the run's own
  ``perf/*_flops``; TP communication; the pipeline bubble with ``m = 8`` micro-batches), plus the host overhead
  that no parallelism divides: ``fwd_layer_s`` per layer and forward micro-batch, ``train_layer_s`` per layer and
  train micro-batch (kernel launches, dispatch: what makes small models and small micro-batches launch-bound),
  over each rank's ``m + pp - 1`` pipeline slots of ``layers / pp``; micro-batches per rank from the token budgets
  (``train.max_tokens_per_micro_batch``, forward's) or ``micro_batch_size``; plus TP's collectives
  (``4 x layers / pp + 3`` per micro-batch and pass: sequence-parallel all-gather / reduce-scatter around
  attention and MLP, the vocabulary-parallel head's reductions; each ``collective latency + activation bytes /
  link``) and the data-parallel gradient all-reduce, ``2 (dp-1)/dp x gradient bytes / (tp pp) / link``.
  Calibration keeps MFU at its prior and gives the overheads the rest of the measured phases (a run faster than
  the prior allows raises MFU instead).
* rollout per engine (``N / engines`` sequences): a roofline of memory bandwidth, ``S x weight bytes / (tp x HBM)``
  for ``S`` decode steps (the expected longest response of the engine's batch) plus the KV cache read at each
  token, plus the FLOPs of every generated sequence (prefill and decode) at ``decode_flop_eff`` of the peak;
  the whole times a calibrated ``rollout_scale`` (1 on GPUs before calibration).
* weight sync: ``sync_overhead_s + weight bytes / (tp x pp sending ranks x link GB/s x 0.7)`` (on CPU the overhead
  at the trainer ranks' core share, below); the link is
  NVLink when trainers and engines share a node (colocated, or disaggregated within one node), else the NIC.
* other (reward, advantages, batching): ``other_per_seq_s x N``; colocated placement adds the memory
  hand-over ``handoff_s`` (engines release / resume, trainer offload).
* mode: ``sync`` adds rollout and trainer; ``one_step`` and ``async`` (disaggregated placement only: colocated engines
  and trainers share the devices) overlap them, ``max(rollout, trainer)``; ``async`` with staleness ``k`` also
  shortens the decode tail: ``S = E[r] + (E[max r] - E[r]) / (k + 1)`` (generation continues across steps).
  On CPU the processes share ``cores``, less the ``background_cores`` the driver and Ray's processes keep
  busy: ``P`` processes running at once get ``min(1, (cores - background) / P)`` of a core each (every trainer
  term and the weight sync's overhead run at that share), and overlapped work takes at least its core-seconds
  over the cores left. (A load correction by the matmul rate measured before
  and after each run made the CPU validation worse -- the same config measured twice was predicted 3x apart
  -- so the machine's load is not modelled: calibrate and plan on the same, quiet machine.)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Dict

import numpy as np

from megatron_rl.bench.workload import LengthDist
from megatron_rl.perf import ModelFlops
from megatron_rl.plan.devices import Device

TP_EFF_PER_DOUBLING = 0.92
PP_MICRO_BATCHES = 8


@dataclass(frozen=True)
class ModelShape:
    flops: ModelFlops
    params: float  # all parameters (every expert): weight bytes, memory
    active: float  # matmul parameters a token runs through
    kv_dim: int  # K + V width per layer (for MLA: the latent)
    layers: int
    num_experts: int
    bytes_per_param: int = 2
    hidden: int = 0  # the residual stream's width (TP's activation collectives)

    @classmethod
    def from_arch(cls, arch, bytes_per_param: int = 2) -> "ModelShape":
        f = ModelFlops.from_arch(arch)
        h = arch.hidden_size
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        attn = h * q + 2 * h * kv + q * h
        moe_layers = arch.moe_layers or (False,) * arch.num_layers
        experts = h * arch.num_experts + arch.num_experts * 3 * h * arch.moe_ffn_hidden_size
        per_layer = sum(attn + (experts if moe else 3 * h * arch.ffn_hidden_size) for moe in moe_layers)
        embed = arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2)
        return cls(f, float(per_layer + embed), float(f.linear_params), 2 * kv, arch.num_layers, arch.num_experts,
                   bytes_per_param, h)

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param


@dataclass(frozen=True)
class PlanWorkload:
    prompts: int  # per step
    samples: int  # per prompt
    prompt: LengthDist
    response: LengthDist
    train_mb_tokens: int = 16384  # train.max_tokens_per_micro_batch (0: micro_batch_size sequences)
    forward_mb_tokens: int = 0  # train.forward_max_tokens_per_micro_batch (0: as train)
    micro_batch_size: int = 1

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples

    def micro_batches(self, dp: int) -> "tuple[int, int]":
        """(forward, train) micro-batches of one data-parallel rank: sequences of the mean length packed under
        the token budget (``token_budget.py`` gives every rank the same count)."""
        ep, er = self.prompt.expected()[0], self.response.expected()[0]
        seqs = math.ceil(self.sequences / dp)

        def count(budget: int) -> int:
            per = self.micro_batch_size if budget <= 0 else max(1, int(budget // (ep + er)))
            return math.ceil(seqs / per)

        return count(self.forward_mb_tokens or self.train_mb_tokens), count(self.train_mb_tokens)

    def moments(self):
        ep, ep2 = self.prompt.expected()
        er, er2 = self.response.expected()
        return ep, er, ep2 + 2 * ep * er + er2

    def expected_max_response(self, n: int) -> float:
        return expected_max(self.response, max(1, n))


@functools.lru_cache(maxsize=4096)
def expected_max(dist: LengthDist, n: int, draws: int = 64) -> float:
    """E[max of n drawn lengths] (a fixed-seed Monte Carlo: deterministic)."""
    if dist.kind == "fixed":
        return float(dist.value)
    rng = np.random.default_rng(0)
    return float(np.mean([dist.draw(n, rng).max() for _ in range(draws)]))


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    trainers: int = 1  # trainer devices (dp = trainers / (tp pp))
    engines: int = 1  # engine servers
    engine_tp: int = 1  # devices per engine
    placement: str = "colocated"  # colocated | disaggregated
    mode: str = "sync"  # sync | one_step | async
    staleness: int = 1  # async k

    @property
    def dp(self) -> int:
        return self.trainers // (self.tp * self.pp)

    @property
    def engine_devices(self) -> int:
        return self.engines * self.engine_tp

    @property
    def devices(self) -> int:
        return max(self.trainers, self.engine_devices) if self.placement == "colocated" else \
            self.trainers + self.engine_devices

    def describe(self) -> str:
        mode = f"async k={self.staleness}" if self.mode == "async" else self.mode
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        split = "colocated" if self.placement == "colocated" else f"disaggregated {self.engine_devices}:{self.trainers}"
        return (f"tp{self.tp} pp{self.pp}{ep} dp{self.dp}; {self.engines} engine(s) x tp{self.engine_tp}; "
                f"{split}; {mode}")


@dataclass(frozen=True)
class Efficiency:
    """The calibrated constants (defaults: before any calibration; ``source`` says which)."""

    base_mfu: float = 0.45  # trainer MFU of a tp1 pp1 layout (the FLOP term; calibration keeps it)
    trainer_passes: float = 4.0  # k: trainer FLOPs / F_fwd
    forward_passes: float = 1.0  # of which forward-only passes (old log-probs, reference, diagnostics)
    fwd_layer_s: float = 1e-4  # host overhead per layer and forward micro-batch, one rank, a core to itself
    train_layer_s: float = 3e-4  # the same per train micro-batch (forward + backward)
    decode_bw_eff: float = 0.6
    decode_flop_eff: float = 0.5
    rollout_scale: float = 1.0
    sync_overhead_s: float = 0.5
    other_per_seq_s: float = 1e-4
    handoff_s: float = 1.0
    source: str = "defaults"

    def mfu(self, tp: int, pp: int) -> float:
        return self.base_mfu * layout_prior(tp, pp)


def layout_prior(tp: int, pp: int) -> float:
    return TP_EFF_PER_DOUBLING ** math.log2(tp) * PP_MICRO_BATCHES / (PP_MICRO_BATCHES + pp - 1)


@dataclass
class Prediction:
    layout: Layout
    phases: Dict[str, float]
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    fits: bool = True
    why: str = ""

    def as_dict(self) -> Dict[str, object]:
        return {"layout": self.layout.describe(), **{f"time/{k}": v for k, v in self.phases.items()},
                "step_s": self.step_s, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu,
                "fits": self.fits, "why": self.why}


def _eff_devices(n: int, dev: Device) -> int:
    return min(n, dev.cores) if dev.cores else n


def core_share(processes: int, dev: Device) -> float:
    """The share of a core each of ``processes`` CPU processes running at once gets (1 on GPUs)."""
    if not dev.cores:
        return 1.0
    return min(1.0, max(dev.cores - dev.background_cores, 0.5) / max(processes, 1))


def rollout_seconds(shape: ModelShape, work: PlanWorkload, lay: Layout, dev: Device, eff: Efficiency) -> float:
    ep, er, e_sq = work.moments()
    n = work.sequences / lay.engines
    steps = work.expected_max_response(int(round(n)))
    if lay.mode == "async":
        steps = er + (steps - er) / (lay.staleness + 1)
    tp = _eff_devices(lay.engine_tp, dev) if dev.cores else lay.engine_tp
    share = _eff_devices(lay.engine_devices, dev) / lay.engine_devices  # CPU: engines past the cores wait
    bw = dev.hbm_bytes_per_s * eff.decode_bw_eff * tp * share
    kv_read = n * er * (ep + er / 2.0) * shape.layers * shape.kv_dim * shape.bytes_per_param  # summed over tokens
    memory = (steps * shape.weight_bytes + kv_read) / bw
    compute = shape.flops.forward(n * (ep + er), n * e_sq) / (dev.peak_flops * eff.decode_flop_eff * tp * share)
    return eff.rollout_scale * (memory + compute)


def trainer_seconds(shape: ModelShape, work: PlanWorkload, lay: Layout, dev: Device, eff: Efficiency) -> float:
    return sum(trainer_terms(shape, work, lay, dev, eff).values())


def trainer_terms(shape: ModelShape, work: PlanWorkload, lay: Layout, dev: Device, eff: Efficiency) -> Dict[str, float]:
    """The trainer's time in its terms: ``flops``, ``fwd_overhead``, ``train_overhead``, ``fwd_tp``, ``train_tp``,
    ``dp``."""
    ep, er, e_sq = work.moments()
    n = work.sequences
    fwd = shape.flops.forward(n * (ep + er), n * e_sq)
    share = core_share(lay.trainers, dev)
    flops = eff.trainer_passes * fwd / (lay.trainers * share * dev.peak_flops * eff.mfu(lay.tp, lay.pp))
    n_fwd, n_train = work.micro_batches(lay.dp)
    stage_layers = shape.layers / lay.pp
    fwd_slots, train_slots = eff.forward_passes * (n_fwd + lay.pp - 1), n_train + lay.pp - 1
    out = {"flops": flops, "fwd_overhead": fwd_slots * stage_layers * eff.fwd_layer_s / share,
           "train_overhead": train_slots * stage_layers * eff.train_layer_s / share, "fwd_tp": 0.0, "train_tp": 0.0,
           "dp": 0.0}
    if lay.tp > 1:
        tokens = n * (ep + er) / lay.dp  # one rank's; forward and backward each collect once per micro-batch
        out["fwd_tp"] = fwd_slots * tp_collectives_seconds(shape, stage_layers, tokens / n_fwd, lay, dev) / share
        out["train_tp"] = 2 * train_slots * tp_collectives_seconds(shape, stage_layers, tokens / n_train, lay,
                                                                   dev) / share
    if lay.dp > 1:
        link = dev.intra_gb_per_s if lay.trainers <= dev.per_node else dev.inter_gb_per_s
        out["dp"] = (2 * (lay.dp - 1) / lay.dp * shape.weight_bytes / (lay.tp * lay.pp) / (link * 1e9)
                     + 2 * dev.collective_latency_s / share)
    return out


def tp_collectives_seconds(shape: ModelShape, layers: float, tokens: float, lay: Layout, dev: Device) -> float:
    """One micro-batch's TP collectives in one pass (forward or backward): ``4 x layers + 3`` of them, each the
    latency plus ``(tp-1)/tp`` of the activations (``tokens x hidden``) over the link."""
    count = 4 * layers + 3
    bytes_ = tokens * shape.hidden * shape.bytes_per_param * (lay.tp - 1) / lay.tp
    return count * dev.collective_latency_s + 4 * layers * bytes_ / (dev.intra_gb_per_s * 1e9)


def sync_seconds(shape: ModelShape, lay: Layout, dev: Device, eff: Efficiency) -> float:
    one_node = lay.placement == "colocated" or lay.devices <= dev.per_node
    link = dev.intra_gb_per_s if one_node else dev.inter_gb_per_s
    return (eff.sync_overhead_s / core_share(lay.trainers, dev)
            + shape.weight_bytes / (lay.tp * lay.pp) / (link * 1e9 * 0.7))


def predict(shape: ModelShape, work: PlanWorkload, lay: Layout, dev: Device, eff: Efficiency) -> Prediction:
    ep, er, e_sq = work.moments()
    n = work.sequences
    roll = rollout_seconds(shape, work, lay, dev, eff)
    trainer = trainer_seconds(shape, work, lay, dev, eff)
    sync = sync_seconds(shape, lay, dev, eff)
    other = eff.other_per_seq_s * n + (eff.handoff_s if lay.placement == "colocated" else 0.0)
    if lay.mode != "sync" and lay.placement == "disaggregated":
        busy = max(roll, trainer)
        if dev.cores:  # overlapping processes share the cores the driver and Ray leave
            core_s = (roll * _eff_devices(lay.engine_devices, dev)
                      + trainer * lay.trainers * core_share(lay.trainers, dev))  # its time is at that share
            busy = max(busy, core_s / max(dev.cores - dev.background_cores, 0.5))
    else:
        busy = roll + trainer
    step = busy + sync + other
    flops = eff.trainer_passes * shape.flops.forward(n * (ep + er), n * e_sq) + shape.flops.forward(n * (ep + er),
                                                                                                   n * e_sq)
    devices = lay.devices
    fits, why = memory_fits(shape, lay, dev, n * (ep + er))
    return Prediction(lay, {"rollout": roll, "trainer": trainer, "weight_sync": sync, "other": other,
                            "overlap_saved": roll + trainer - busy}, step,
                      n * (ep + er) / (step * devices), flops / (step * devices * dev.peak_flops), fits, why)


def memory_fits(shape: ModelShape, lay: Layout, dev: Device, tokens: float) -> "tuple[bool, str]":
    """Trainer: bf16 weights + fp32 master and Adam (16 bytes/param) over tp x pp (x ep for experts); engine:
    weights over its tp (colocated: the trainer's state is offloaded while engines run, so the larger of the
    two either way). Activations and the KV cache are not counted."""
    gib = 2.0 ** 30
    shard = lay.tp * lay.pp * (lay.ep if shape.num_experts else 1)
    trainer = 16 * shape.params / shard / gib
    engine = shape.params * shape.bytes_per_param / lay.engine_tp / gib
    need = max(trainer, engine)
    if need > 0.9 * dev.memory_gib:
        return False, f"needs ~{need:.0f} GiB of {dev.memory_gib:.0f} per device"
    return True, ""
