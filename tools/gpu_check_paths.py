"""The prepared GPU check's sections over the framework's own GPU paths (tools/gpu_check.py runs them):

  trainer     PolicyTrainer, parameters bf16, from a Qwen3-shaped random checkpoint (0.6 B: hidden 1024, 28
              layers, 151936 vocabulary), a long-tailed batch built on the host (64 sequences, longest 4096
              tokens, packed under a 16384-token budget): forward, then two decoupled train steps; a padded and
              an unfused-head variant; a Qwen3-MoE shape (64 experts, top-8) with routing replay. tokens/s, MFU
              against the measured bf16 matmul rate, peak memory; losses finite, the second step's loss differs
  checkpoint  save after one step, build a fresh trainer, load: the next two steps' losses and grad norms
              equal the uninterrupted run's (CPU: bitwise; GPU: 1e-3 relative, kernels may reduce atomically)
  sync        trainer -> embedded engine on the same device after a train step: the probe check passes
              (fp32 and bf16 engine)
  rl_loop     one process, no Ray: trainer + embedded engine on one device, 30 GRPO steps (generate, reward,
              forward, train, weight sync) on a tiny task; the mean reward rises; seconds per step

``--cpu`` (CI): tiny shapes, and every section runs under the placement guard (tests/device_guard.py), so
a tensor left on the host fails there as it would on a GPU.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import tempfile
import time

import torch


# ---- shared --------------------------------------------------------------------------------------------
def _guard(ctx):
    """The placement guard in CPU mode (a CUDA run places for real)."""
    if not ctx.cpu:
        return contextlib.nullcontext(None)
    from device_guard import DeviceGuard  # tests/ is on sys.path (gpu_check.py)

    return DeviceGuard()


def _groups(ctx):
    from megatron_rl import parallel

    ctx.init_megatron()
    return parallel.init_megatron_parallel(parallel.ParallelLayout())


def _checkpoint(ctx, kind: str = "dense", big: bool = True) -> str:
    """A random HF checkpoint: tiny on CPU; Qwen3-0.6B's shape (``big``) or a 4-layer one on GPU."""
    from multiproc import tiny_hf_checkpoint

    size = {}
    if not ctx.cpu:
        size = dict(hidden_size=1024, num_hidden_layers=28 if big else 4, num_attention_heads=16,
                    num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                    vocab_size=151936 if big else 32000, max_position_embeddings=8192)
        if kind == "moe":
            size.update(num_hidden_layers=8, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=384)
    key = (kind, big)
    cache = ctx.__dict__.setdefault("_checkpoints", {})
    if key not in cache:
        model_type = "qwen3_moe" if kind == "moe" else "qwen3"
        cache[key] = tiny_hf_checkpoint(os.path.join(tempfile.mkdtemp(), model_type), model_type, **size)
    return cache[key]


def _batch(ctx, vocab: int, n: int, longest: int, seed: int = 0, moe=None):
    """A long-tailed RL batch built on the host: response lengths ~ lognormal, one sequence ``longest`` long."""
    from megatron_rl.training import TrainBatch

    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(8, max(9, longest // 16), (n,), generator=g)
    rlen = (torch.randn(n, generator=g) * 0.8).exp() * (longest / 12)
    rlen = rlen.long().clamp(1, longest - int(plen.max()))
    rlen[0] = longest - int(plen[0])
    ids = [torch.randint(0, vocab, (int(p + r),), generator=g) for p, r in zip(plen, rlen)]
    routed = None
    if moe is not None:  # [P + R, layers, topk] distinct expert ids per token
        layers, experts, topk = moe
        routed = [torch.rand(len(x), layers, experts, generator=g).argsort(-1)[..., :topk] for x in ids]
    batch = TrainBatch.from_sequences([x[:p] for x, p in zip(ids, plen)], [x[p:] for x, p in zip(ids, plen)],
                                      routed_experts=routed, group_ids=torch.arange(n) // 4)
    B, R = batch.response_mask.shape
    rollout = -torch.rand(B, R, generator=g) * 3 - 0.5
    return batch.replace(advantages=torch.randn(B, R, generator=g), rollout_logprobs=rollout)


def _trainer(ctx, path: str, groups, lr: float, dtype=None, **train_kw):
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.training import OptimConfig, PolicyTrainer, TrainConfig

    dtype = dtype or ("float32" if ctx.cpu else "bfloat16")
    return PolicyTrainer(ModelConfig(hf_path=path, dtype=dtype), TrainConfig(**train_kw), groups,
                         OptimConfig(lr=lr, clip_grad=1.0))


def _free(ctx):
    gc.collect()
    if not ctx.cpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# ---- trainer ---------------------------------------------------------------------------------------------
def section_trainer(ctx) -> dict:
    from megatron_rl.perf import ModelFlops, measure_matmul_flops, sum_sq

    groups = _groups(ctx)
    dtype = torch.float32 if ctx.cpu else torch.bfloat16
    peak = measure_matmul_flops(ctx.device, dtype, seconds=0.1 if ctx.cpu else 0.5)
    n, longest, budget = (8, 48, 64) if ctx.cpu else (64, 4096, 16384)
    variants = {  # checkpoint kind, train config
        "dense packed fused": ("dense", dict(packing=True, max_tokens_per_micro_batch=budget, fused_head=True)),
        "dense padded": ("dense", dict(packing=False, micro_batch_size=2 if ctx.cpu else 4)),
        "dense packed unfused head": ("dense", dict(packing=True, max_tokens_per_micro_batch=budget,
                                                    fused_head=False)),
        "moe packed routing replay": ("moe", dict(packing=True, max_tokens_per_micro_batch=budget,
                                                  routing_replay=True)),
    }
    out = {"matmul_tflops_measured": peak / 1e12}
    for name, (kind, tc) in variants.items():
        _free(ctx)
        # lr 1e-3: Adam's first step moves a weight by ~lr, which must exceed a bf16 ulp for the loss to move
        tr = _trainer(ctx, _checkpoint(ctx, kind), groups, lr=1e-3, **tc)
        arch = tr.built.arch
        moe = None
        if kind == "moe":
            moe = (len(tr.routing.moe_layers), arch.num_experts, arch.moe_topk)
        batch = _batch(ctx, arch.vocab_size, n, longest, moe=moe)
        lengths = batch.seq_lengths.tolist()
        with _guard(ctx) as guard:
            if guard is not None:
                guard.place_trainer(tr)
                guard.host(batch)
            t0 = time.perf_counter()
            fwd = tr.forward(batch)
            ctx.sync()
            fwd_s = time.perf_counter() - t0
            batch = batch.replace(old_logprobs=fwd.logprobs)
            steps = []
            for _ in range(2):
                t0 = time.perf_counter()
                r = tr.train_step(batch)
                ctx.sync()
                steps.append((r.loss, r.grad_norm, time.perf_counter() - t0))
        tokens = sum(lengths)
        flops = ModelFlops.from_arch(arch).forward(tokens, sum_sq(lengths))
        step_s = steps[1][2]  # the second: warm
        out[name] = {
            "parameters_B": sum(p.numel() for p in tr.module.parameters()) / 1e9,
            "sequences": n, "tokens": tokens, "longest": max(lengths), "forward_s": fwd_s, "train_step_s": step_s,
            "train_tokens_per_s": tokens / step_s, "forward_tokens_per_s": tokens / fwd_s,
            "train_mfu_vs_measured_matmul": 3 * flops / step_s / peak,
            "peak_memory_GiB": torch.cuda.max_memory_allocated() / 2**30 if not ctx.cpu else float("nan"),
            "loss_1": steps[0][0], "loss_2": steps[1][0], "grad_norm_1": steps[0][1],
            "logprobs_on_host": fwd.logprobs.device.type == "cpu",
            "ok": all(math.isfinite(s[0]) and math.isfinite(s[1]) for s in steps) and steps[0][0] != steps[1][0],
        }
        del tr, fwd
    out["ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out


# ---- checkpoint -------------------------------------------------------------------------------------------
def section_checkpoint(ctx) -> dict:
    from megatron_rl.training import checkpoint as ck

    groups = _groups(ctx)
    _free(ctx)
    path = _checkpoint(ctx, "dense", big=False)
    tc = dict(packing=True, max_tokens_per_micro_batch=64 if ctx.cpu else 8192)
    tr, fresh = _trainer(ctx, path, groups, lr=1e-4, **tc), _trainer(ctx, path, groups, lr=1e-4, **tc)
    batches = [_batch(ctx, tr.built.arch.vocab_size, 8 if ctx.cpu else 32, 32 if ctx.cpu else 1024, seed=s)
               for s in range(3)]
    batches = [b.replace(old_logprobs=b.rollout_logprobs) for b in batches]
    cfg = ck.CheckpointConfig(tempfile.mkdtemp(), keep_last=1)
    with _guard(ctx) as guard:
        if guard is not None:
            guard.place_trainer(tr)
            guard.place_trainer(fresh)
            for b in batches:
                guard.host(b)
        tr.train_step(batches[0])
        t0 = time.perf_counter()
        ck.save_checkpoint(tr, cfg)
        save_s = time.perf_counter() - t0
        straight = [(r.loss, r.grad_norm) for r in (tr.train_step(b) for b in batches[1:])]
        t0 = time.perf_counter()
        ck.load_checkpoint(fresh, cfg.root)
        load_s = time.perf_counter() - t0
        resumed = [(r.loss, r.grad_norm) for r in (fresh.train_step(b) for b in batches[1:])]
    rel = max(abs(a - b) / max(abs(b), 1e-30) for x, y in zip(resumed, straight) for a, b in zip(x, y))
    tol = 0.0 if ctx.cpu else 1e-3
    return {"save_s": save_s, "load_s": load_s, "uninterrupted_losses": [x[0] for x in straight],
            "resumed_losses": [x[0] for x in resumed], "max_rel_diff_loss_and_grad_norm": rel, "tolerance": tol,
            "ok": rel <= tol}


# ---- sync ----------------------------------------------------------------------------------------------
def _engine(ctx, path: str, dtype, guard, **cfg):
    from megatron_rl.rollout.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig

    model = EmbeddedEngine.from_pretrained(path, dtype=dtype, device=ctx.device.type).model
    if guard is not None:
        guard.place(model)
    return EmbeddedEngine(model, EmbeddedEngineConfig(**cfg))  # its device: its parameters'


def section_sync(ctx) -> dict:
    from megatron_rl.weights.sync import WeightSync, WeightSyncConfig

    groups = _groups(ctx)
    _free(ctx)
    path = _checkpoint(ctx, "dense", big=False)
    tr = _trainer(ctx, path, groups, lr=1e-3, dtype="float32", packing=True)
    batch = _batch(ctx, tr.built.arch.vocab_size, 8, 32 if ctx.cpu else 512)
    batch = batch.replace(old_logprobs=batch.rollout_logprobs)
    out = {}
    with _guard(ctx) as guard:
        if guard is not None:
            guard.place_trainer(tr)
            guard.host(batch)
        tr.train_step(batch)  # the engine's weights (the checkpoint's) are now stale
        for dtype in (torch.float32, torch.bfloat16):
            engine = _engine(ctx, path, dtype, guard)
            t0 = time.perf_counter()
            stats = WeightSync(tr.built, engine, WeightSyncConfig(progress=False)).sync(version=str(dtype))
            ctx.sync()
            out[str(dtype)[6:]] = {"sync_and_check_s": time.perf_counter() - t0,
                                   "probe_max_abs_diff": stats.check.max_abs_diff}
            del engine
    return out  # a failed probe check raises (WeightMismatchError): the section is then an error


# ---- rl_loop ----------------------------------------------------------------------------------------------
def _reward(response) -> float:
    """The tiny task: the share of response tokens in the lower quarter of the vocabulary (~0.25 at random)."""
    return sum(1.0 for t in response if t < 16) / max(1, len(response))


def section_rl_loop(ctx) -> dict:
    from megatron_rl.advantages.outcome import grpo
    from megatron_rl.orchestration.batching import token_rewards
    from megatron_rl.rollout.client.protocol import GenerateRequest, SamplingParams
    from megatron_rl.weights.sync import WeightSync, WeightSyncConfig
    from multiproc import tiny_hf_checkpoint
    from megatron_rl.training import TrainBatch

    groups = _groups(ctx)
    _free(ctx)
    path = tiny_hf_checkpoint(os.path.join(tempfile.mkdtemp(), "qwen3"), "qwen3", vocab_size=64)
    tr = _trainer(ctx, path, groups, lr=3e-3, dtype="float32", packing=True, max_tokens_per_micro_batch=256)
    prompts_n, group, new = (8, 4, 6) if ctx.cpu else (16, 8, 16)
    g = torch.Generator().manual_seed(0)
    rewards, times = [], []
    with _guard(ctx) as guard:
        if guard is not None:
            guard.place_trainer(tr)
        engine = _engine(ctx, path, torch.float32, guard, seed=1)
        sync = WeightSync(tr.built, engine, WeightSyncConfig(progress=False))
        for step in range(30):
            t0 = time.perf_counter()
            prompts = [tuple(torch.randint(16, 64, (4,), generator=g).tolist()) for _ in range(prompts_n)]
            samples = engine.generate([GenerateRequest(p, SamplingParams(max_new_tokens=new, n=group, ignore_eos=True,
                                                                         seed=step * 1000 + i))
                                       for i, p in enumerate(prompts)])
            scores = [_reward(s.response_ids) for s in samples]
            batch = TrainBatch.from_sequences([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                                              rollout_logprobs=[s.logprobs for s in samples],
                                              group_ids=[i // group for i in range(len(samples))])
            adv = grpo(token_rewards(batch.response_mask, scores), batch.response_mask, batch.group_ids)
            batch = batch.replace(advantages=adv)
            if guard is not None:
                guard.host(batch)
            batch = batch.replace(old_logprobs=tr.forward(batch).logprobs)
            tr.train_step(batch)
            sync.sync(version=step + 1)
            ctx.sync()
            times.append(time.perf_counter() - t0)
            rewards.append(sum(scores) / len(scores))
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    return {"steps": len(rewards), "samples_per_step": prompts_n * group, "new_tokens": new,
            "mean_reward_first5": first, "mean_reward_last5": last, "seconds_per_step": sorted(times)[len(times) // 2],
            "ok": last > first}


FUNCS = {"trainer": section_trainer, "checkpoint": section_checkpoint, "sync": section_sync,
         "rl_loop": section_rl_loop}
