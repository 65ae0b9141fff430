"""Test support (not part of the package): run a function on N local processes joined by a gloo (or nccl)
process group.

Used by the distributed tests and by the benchmarks. Every child runs ``fn(*args)`` after the default
process group is up; the parent returns the per-rank results, or raises with the failing child's
traceback. Nothing hangs: the whole run has a deadline, after which every child is killed and the
ranks that had not finished are named.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, List, Optional


class DistributedTestError(RuntimeError):
    """A child process failed or timed out; the message carries its traceback."""


def _exit_with_parent(parent_pid: int) -> None:
    """Children are not daemonic (Megatron's checkpoint writer starts its own processes, which a
    daemonic process may not), so each one watches its parent and exits if the parent is gone."""
    import threading

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def _child(rank: int, world_size: int, init_file: str, backend: str, fn, args, results, parent_pid: int) -> None:
    _exit_with_parent(parent_pid)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
    )
    try:
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        import torch.distributed as dist

        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        # Pickle here so an unpicklable result is reported as this rank's error, not lost in the
        # queue's feeder thread.
        results.put((rank, "ok", pickle.dumps(fn(*args))))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            from megatron_rl import parallel

            parallel.destroy()
        except BaseException:  # noqa: BLE001
            pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    backend: str = "gloo",
    threads_per_rank: Optional[int] = None,
) -> List[Any]:
    """Run ``fn(*args)`` on ``world_size`` processes; return the list of per-rank return values.

    ``fn`` and ``args`` must be picklable (a module-level function). Children start with the ``spawn``
    method so they never inherit a half-initialised parent state.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    env_threads = str(threads_per_rank or max(1, (os.cpu_count() or 1) // world_size))
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = env_threads
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_child, args=(r, world_size, init_file, backend, fn, args, results, os.getpid()),
                        daemon=False)
            for r in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
        finally:
            if old is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = old
        outputs: dict = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(outputs) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(world_size)) - set(outputs))
                    raise DistributedTestError(
                        f"timed out after {timeout_s:.0f} s waiting for rank(s) {missing} of {world_size}"
                    )
                try:
                    rank, status, payload = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outputs]
                    if dead:
                        # A child died without reporting (segfault, OOM kill): give the queue a moment.
                        try:
                            rank, status, payload = results.get(timeout=2.0)
                        except queue.Empty:
                            codes = {r: procs[r].exitcode for r in dead}
                            raise DistributedTestError(f"rank(s) died without a report, exit codes {codes}")
                    else:
                        continue
                if status == "error":
                    raise DistributedTestError(f"rank {rank} of {world_size} failed:\n{payload}")
                outputs[rank] = pickle.loads(payload)
        finally:
            for p in procs:
                p.join(timeout=5)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    return [outputs[r] for r in range(world_size)]


# Tiny HF configs for tests (no downloads). Vocabulary 250 is deliberately not a multiple of 128.
_TINY_COMMON = dict(
    vocab_size=250,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
TINY_MODELS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=96, rope_theta=1e6)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=96, rope_theta=1e6)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=96, rope_theta=5e5)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
             norm_topk_prob=True, rope_theta=1e6),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6),
    ),
    # (HF: head_dim is the rotary width) MLA with a query LoRA rank (q_lora_rank=None: a plain q projection), 1 dense + 2 MoE layers of 8 experts
    # (4 groups, top-2 groups, top-4 experts), a shared expert, a sigmoid router with a score bias
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
             n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
             first_k_dense_replace=1, routed_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=32,
             qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, v_head_dim=16, rope_theta=1e4),
    ),
    # GLM-4.5-style: q/k/v bias, q/k norm, partial RoPE (half of each head), 1 dense + 2 MoE layers of 8 experts
    # (2 groups, top-1 group, top-2 experts), a shared expert, a sigmoid router with a score bias
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
             n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
             routed_scaling_factor=1.5, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
             rope_theta=1e4, num_nextn_predict_layers=0),
    ),
}


def tiny_hf_checkpoint(path: str, model_type: str, seed: int = 0, **overrides: Any) -> str:
    """Save a tiny random ``model_type`` HF causal LM (float32, safetensors) to ``path``; return it.

    Weights are drawn with a wider std than HF's 0.02 so that layers actually change the logits.
    """
    import torch
    import transformers

    if model_type not in TINY_MODELS:
        raise ValueError(f"unknown tiny model type {model_type!r}; known: {sorted(TINY_MODELS)}")
    cfg_cls, model_cls, extra = TINY_MODELS[model_type]
    kwargs = {**_TINY_COMMON, **extra, **overrides}
    config = getattr(transformers, cfg_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # non-trivial norms catch a missing / misplaced norm weight
            else:
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's router bias: must shift the top-k
                b.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return path
