#!/usr/bin/env python
"""A prepared GPU check: one run (<= 8 minutes on one H200) of what CPU tests cannot show.

Sections (each guarded: a failure is recorded and the next section runs; the JSON is rewritten after
every section, so a run cut short keeps what it measured):

  env          versions, the device, its table peak, a measured bf16 matmul rate and copy bandwidth
  head         the output layer + log-prob/entropy loss, forward + backward, at T=16384, V=152064,
               H=4096, bf16: the fused head (Triton row kernels; also its torch row passes), the unfused
               ops on materialised logits, Megatron's vocab_parallel_cross_entropy (log-prob only). Time,
               peak memory above the inputs, TFLOP/s of the matmuls executed (the fused head does 4
               T*V*H*2 matmuls, the others 3) against the H200's measured 790 TFLOP/s; GB/s of the row
               kernels alone (Triton; unfused ops) against ~4.3 TB/s
  ops          every vocab-parallel op on the device (fp32, bf16) against a float64 CPU reference:
               values and gradients (logits; hidden states and weight for the fused ops)
  megatron_hf  a Megatron GPTModel (local spec, TP=1) forward/backward against HF transformers on the
               same weights: logits and every parameter's gradient
  trainer, checkpoint, sync, rl_loop: the framework's own GPU paths (tools/gpu_check_paths.py; on --cpu under
               the placement guard of tests/device_guard.py)
  engine       the embedded rollout engine on the device: generate (twice: the same seeds give the same
               tokens), then recompute the sampled tokens' log-probs with one teacher-forced forward;
               agreement and generation tokens/s

  bash tools/gpu_check.sh                       # on the GPU machine (wheels: see gpu_check.sh)
  bash tools/gpu_check.sh --cpu                 # small sizes on CPU (CI runs this: tests/unit/test_gpu_check.py)
  python tools/gpu_check.py --sections head,ops --out /tmp/x.json
Prints a markdown table per section and writes JSON to --out (default $OUT/gpu_check.json when $OUT is
set, else bench_results/gpu_check.json). Exit status 1 when a section failed or a check is out of tolerance.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # ops_reference: the float64 references the tests use

import torch  # noqa: E402

import gpu_check_paths  # noqa: E402  (trainer, checkpoint, sync, rl_loop: the framework's own GPU paths)
import gpu_check_hybrid  # noqa: E402  (gdn: a Gated-DeltaNet layer == HF's, on request only)

H200_BF16_TFLOPS, H200_TBPS = 790.0, 4.3  # measured ceilings on this workplace's H200 (device KINDS.md)
SECTIONS = ("env", "head", "ops", "megatron_hf", "trainer", "checkpoint", "sync", "engine", "rl_loop")


class Ctx:
    def __init__(self, cpu: bool):
        self.cpu = cpu
        self.device = torch.device("cpu" if cpu else "cuda")
        self.distributed = False

    def sync(self):
        if not self.cpu:
            torch.cuda.synchronize()

    def init_megatron(self):
        """A one-process group and Megatron's parallel state at TP=1 (CE and GPTModel need it)."""
        if self.distributed:
            return
        from megatron_rl import parallel

        parallel.init_process_group(0, 1, backend="gloo" if self.cpu else "nccl")
        parallel.init_megatron_parallel(parallel.ParallelLayout())
        self.distributed = True


# ---- sections --------------------------------------------------------------------------------------------
def section_env(ctx: Ctx) -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "device": str(ctx.device)}
    for mod in ("triton", "megatron.core", "transformers"):
        try:
            out[mod] = __import__(mod, fromlist=["__version__"]).__version__
        except Exception as e:  # noqa: BLE001 - a missing package is a finding, not a crash
            out[mod] = f"missing ({type(e).__name__})"
    from megatron_rl.perf import device_peak_flops, measure_matmul_flops

    dtype = torch.float32 if ctx.cpu else torch.bfloat16
    out.update(device_peak_flops(dtype, ctx.device))
    out["matmul_tflops_measured"] = measure_matmul_flops(ctx.device, dtype, seconds=0.1 if ctx.cpu else 0.5) / 1e12
    n = (1 << 24) if ctx.cpu else (1 << 30)  # bytes per copy buffer
    a = torch.empty(n, dtype=torch.uint8, device=ctx.device)
    b = torch.empty_like(a)
    b.copy_(a)
    ctx.sync()
    t0 = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    ctx.sync()
    out["copy_tbps_measured"] = 5 * 2 * n / (time.perf_counter() - t0) / 1e12  # bytes read + written
    return out


def _time(ctx: Ctx, fn, reps: int):
    """(median seconds of ``reps`` calls after a warm-up call (Triton compiles there), the last result);
    on CPU one call, no warm-up (the interpreter is slow and the CPU numbers are only a smoke test)."""
    if not ctx.cpu:
        fn()
        ctx.sync()
    times, res = [], None
    for _ in range(reps if not ctx.cpu else 1):
        t0 = time.perf_counter()
        res = fn()
        ctx.sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], res


def _peak_extra(ctx: Ctx, fn) -> float:
    if ctx.cpu:
        return float("nan")  # tools/bench_ops.py measures CPU memory (RSS) in fresh processes
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def section_head(ctx: Ctx) -> dict:
    from megatron_rl.ops import triton_head, vocab_parallel_linear_stats, vocab_parallel_stats

    T, V, H = (64, 2048, 32) if ctx.cpu else (16384, 152064, 4096)
    dtype = torch.float32 if ctx.cpu else torch.bfloat16
    g = torch.Generator(device=ctx.device).manual_seed(0)
    h = (torch.randn(T, H, device=ctx.device, generator=g) / H ** 0.5 * 2).to(dtype).requires_grad_()
    w = torch.randn(V, H, device=ctx.device, generator=g).to(dtype).requires_grad_()
    y = torch.randint(0, V, (T,), device=ctx.device, generator=g)
    w1, w2 = torch.randn(T, device=ctx.device, generator=g), torch.randn(T, device=ctx.device, generator=g)

    def fused(backend):
        def run():
            h.grad = w.grad = None
            st = vocab_parallel_linear_stats(h, w, y, backend=backend)
            ((st.logprobs * w1).sum() + (st.entropy * w2).sum()).backward()
            return st.logprobs.detach()
        return run

    def unfused():
        h.grad = w.grad = None
        st = vocab_parallel_stats(h @ w.t(), y)
        ((st.logprobs * w1).sum() + (st.entropy * w2).sum()).backward()
        return st.logprobs.detach()

    def megatron_ce():
        ctx.init_megatron()
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        h.grad = w.grad = None
        lp = -vocab_parallel_cross_entropy((h @ w.t())[:, None, :], y[:, None])[:, 0]
        (lp * w1).sum().backward()
        return lp.detach()

    methods = {"fused (torch rows)": fused("torch"), "unfused ops": unfused, "megatron CE (log-prob only)": megatron_ce}
    if triton_head.available():  # --cpu: under Triton's interpreter (set in main), the same code path
        methods = {"fused (triton)": fused("triton"), **methods}
    reps = 3
    ref = unfused()
    rows = {}
    mm = 2.0 * T * V * H
    for name, fn in methods.items():  # each method guarded: one failure keeps the others' numbers
        try:
            t, lp = _time(ctx, fn, reps)
            executed = (4 if name.startswith("fused") else 3) * mm
            rows[name] = {"time_s": t, "peak_extra_gib": _peak_extra(ctx, fn), "matmul_tflops": executed / t / 1e12,
                          "pct_of_790": 100 * executed / t / 1e12 / H200_BF16_TFLOPS,
                          "max_abs_logprob_diff_vs_unfused": (lp.float() - ref.float()).abs().max().item()}
        except Exception:  # noqa: BLE001
            rows[name] = {"error": traceback.format_exc()[-1500:]}
        h.grad = w.grad = None
    out = {"T": T, "V": V, "H": H, "dtype": str(dtype), "methods": rows}
    try:  # the row passes alone on one logits block (memory-bound): bytes per pass over the block
        n = 32 if ctx.cpu else 2048
        with torch.no_grad():
            x = (h[:n] @ w.t()).contiguous()
        out["row_kernels"] = _row_kernel_bandwidth(ctx, x, y[:n])
    except Exception:  # noqa: BLE001
        out["row_kernels"] = {"error": traceback.format_exc()[-1500:]}
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    out["ok"] = all("error" not in r for r in [*rows.values(), out["row_kernels"]]) and all(
        r["max_abs_logprob_diff_vs_unfused"] <= tol for n, r in rows.items() if n.startswith("fused"))
    return out


def _row_kernel_bandwidth(ctx: Ctx, x, y) -> dict:
    from megatron_rl.ops import _shard as sh
    from megatron_rl.ops import stats as stm
    from megatron_rl.ops import triton_head, vocab_parallel_stats

    rows, nv = x.shape
    shard = sh.Shard(None, 1, 0, nv, nv)
    nbytes = x.numel() * x.element_size()
    out = {}
    xr = x.clone().requires_grad_()
    gl = torch.ones(rows, device=x.device)

    def torch_ops():
        st = vocab_parallel_stats(xr, y)
        torch.autograd.grad(st.logprobs.sum() + st.entropy.sum(), xr)
    # fwd reads the block, bwd reads it and writes the gradient: 3 block-sized transfers at minimum
    out["unfused ops fwd+bwd GB/s"] = 3 * nbytes / _time(ctx, torch_ops, 3)[0] / 1e9
    if triton_head.available():
        rec = torch.zeros(5, rows, device=x.device)
        y_col = y.clone()
        t_f = _time(ctx, lambda: triton_head.forward_rows(x, y_col, shard, 1.0, None, rec), 3)[0]
        _, saved = stm.finish_forward(rec, None)
        coef = stm.grad_coefficients(saved, torch.ones_like(y, dtype=torch.bool), gl, gl, None, torch.float32)
        g = torch.empty_like(x)
        t_b = _time(ctx, lambda: triton_head.grad_rows(x, g, y_col, rec[stm.M], coef, 1.0, None), 3)[0]
        out["triton forward GB/s (2 reads)"] = 2 * nbytes / t_f / 1e9
        out["triton grad GB/s (read + write)"] = 2 * nbytes / t_b / 1e9
    for k in list(out):
        out[k.replace("GB/s", "% of 4.3 TB/s")] = out[k] / (10 * H200_TBPS)
    return out


def section_ops(ctx: Ctx) -> dict:
    from ops_reference import ref_kl, ref_stats

    from megatron_rl.ops import (vocab_parallel_kl, vocab_parallel_linear_kl, vocab_parallel_linear_stats,
                                 vocab_parallel_stats)

    T, V, VS, H = 96, 1031, 1024, 48  # 7 padding columns
    g = torch.Generator().manual_seed(1)
    h64 = torch.randn(T, H, generator=g, dtype=torch.float64)
    # logits of std ~1.5 (|z| < 8): one bf16 rounding of a logit moves a log-prob by < 0.03
    w64 = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.2
    hr64 = torch.randn(T, H, generator=g, dtype=torch.float64)
    wr64 = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.2
    y = torch.randint(0, VS, (T,), generator=g)
    wts = [torch.randn(T, generator=g, dtype=torch.float64) for _ in range(3)]
    kw = dict(vocab_size=VS, temperature=0.8)
    rows = {}
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        # the reference sees the same rounded inputs (and, for the logits ops, the same rounded logits)
        h, w, hr, wr = (t.to(dtype) for t in (h64, w64, hr64, wr64))
        logits, ref_logits = (h.double() @ w.double().T).to(dtype), (hr.double() @ wr.double().T).to(dtype)
        cases = {
            "stats(logits)": lambda d: (vocab_parallel_stats(d["x"], d["y"], min_p=0.05, **kw), None),
            "kl(logits)": lambda d: (None, vocab_parallel_kl(d["x"], d["xr"], **kw)),
            "linear_stats": lambda d: (vocab_parallel_linear_stats(d["h"], d["w"], d["y"], min_p=0.05, **kw), None),
            "linear_kl": lambda d: (None, vocab_parallel_linear_kl(d["h"], d["w"], d["hr"], d["wr"], **kw)),
        }
        for name, fn in cases.items():
            linear = name.startswith("linear")
            dev = {"x": logits.to(ctx.device).requires_grad_(), "xr": ref_logits.to(ctx.device), "y": y.to(ctx.device),
                   "h": h.to(ctx.device).requires_grad_(), "w": w.to(ctx.device).requires_grad_(),
                   "hr": hr.to(ctx.device), "wr": wr.to(ctx.device)}
            st, kl = fn(dev)
            ins = [dev["h"], dev["w"]] if linear else [dev["x"]]
            rh, rw = h.double().requires_grad_(), w.double().requires_grad_()
            # linear ops: the reference rounds the exact product to the op's dtype, as the device's matmul does
            rx = (rh @ rw.T).to(dtype).double() if linear else logits.double().requires_grad_()
            rxr = ref_logits.double()
            if st is not None:
                ref = ref_stats(rx, y, VS, 0.8, 0.05)
                keys = ["logprobs", "entropy", "pruned_logprobs"]
                got = [getattr(st, k) for k in keys]
                want = [ref[k] for k in keys]
            else:
                got, want = [kl], [ref_kl(rx, rxr, VS, "reverse", 0.8)[0]]
            loss = sum((a.double().cpu() * wts[i]).sum() for i, a in enumerate(got))
            loss_ref = sum((a * wts[i]).sum() for i, a in enumerate(want))
            grads = torch.autograd.grad(loss, ins)
            grads_ref = torch.autograd.grad(loss_ref, [rh, rw] if linear else [rx])
            val_err = max((a.double().cpu() - b.detach()).abs().max().item() for a, b in zip(got, want))
            grad_err = max(((a.double().cpu() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                           for a, b in zip(grads, grads_ref))
            good = val_err <= tol and grad_err <= tol
            ok &= good
            rows[f"{name} {str(dtype)[6:]}"] = {"max_abs_value_err": val_err, "max_rel_grad_err": grad_err,
                                               "tolerance": tol, "ok": good}
    return {"cases": rows, "ok": ok}


def section_megatron_hf(ctx: Ctx) -> dict:
    from megatron_rl.models.build import build_model
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.models.weights import export_hf_state_dict
    from multiproc import tiny_hf_checkpoint

    ctx.init_megatron()
    from transformers import AutoModelForCausalLM

    from megatron_rl import parallel

    size = {} if ctx.cpu else dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                                   num_key_value_heads=4, head_dim=64, intermediate_size=2816, vocab_size=32000)
    B, S = (2, 24) if ctx.cpu else (4, 512)
    path = tiny_hf_checkpoint(os.path.join(tempfile.mkdtemp(), "qwen3"), "qwen3", **size)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(ctx.device)
    groups = parallel.init_megatron_parallel(parallel.ParallelLayout())
    built = build_model(ModelConfig(hf_path=path), groups)
    vocab = built.vocab_size
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab, (B, S), generator=g).to(ctx.device)
    wts = torch.randn(B, S - 1, generator=g).to(ctx.device)

    def loss_of(logits):
        lp = torch.log_softmax(logits[:, :-1, :vocab].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        return (lp * wts).sum()

    ref_logits = hf(input_ids=ids).logits
    loss_of(ref_logits).backward()
    pos = torch.arange(S, device=ctx.device).expand(B, -1)
    logits = built.module(ids, pos, attention_mask=None)
    loss_of(logits).backward()
    params = list(built.module.parameters())
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.grad if p.grad is not None else torch.zeros_like(p)
        grads = export_hf_state_dict(built)
    finally:
        for p, d in zip(params, saved):
            p.data = d
    hf_grads = dict(hf.named_parameters())
    worst = max(((grads[n].to(ctx.device) - hf_grads[n].grad).abs().max()
                 / hf_grads[n].grad.abs().max().clamp_min(1e-30)).item() for n in grads)
    diff = (logits[..., :vocab] - ref_logits).abs().max().item()
    return {"batch": [B, S], "hidden": hf.config.hidden_size, "layers": hf.config.num_hidden_layers,
            "max_abs_logit_diff": diff, "max_rel_grad_diff": worst, "params_compared": len(grads),
            "ok": diff <= 1e-3 and worst <= 1e-3}


def section_engine(ctx: Ctx) -> dict:
    from megatron_rl.rollout.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
    from megatron_rl.rollout.client.protocol import GenerateRequest, SamplingParams
    from multiproc import tiny_hf_checkpoint

    size = {} if ctx.cpu else dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                                   num_key_value_heads=4, head_dim=64, intermediate_size=2816, vocab_size=32000)
    path = tiny_hf_checkpoint(os.path.join(tempfile.mkdtemp(), "qwen3"), "qwen3", **size)
    out = {}
    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, None)):
        engine = EmbeddedEngine.from_pretrained(path, EmbeddedEngineConfig(seed=3), dtype=dtype, device=ctx.device.type)
        vocab = engine.model.config.vocab_size
        g = torch.Generator().manual_seed(4)
        new, prompts, n = (12, 4, 2) if ctx.cpu else (128, 8, 4)
        reqs = [GenerateRequest(tuple(torch.randint(0, vocab, (int(p),), generator=g).tolist()),
                                SamplingParams(max_new_tokens=new, n=n, seed=i, ignore_eos=True))
                for i, p in enumerate(torch.randint(4, 32, (prompts,), generator=g))]
        t0 = time.perf_counter()
        samples = engine.generate(reqs)
        ctx.sync()
        seconds = time.perf_counter() - t0
        same_seed = [s.response_ids for s in engine.generate(reqs)] == [s.response_ids for s in samples]
        diff = 0.0
        for s in samples:
            lp = engine.prompt_logprobs(list(s.prompt_ids) + list(s.response_ids))[0]
            diff = max(diff, (lp[len(s.prompt_ids) - 1:] - torch.tensor(s.logprobs)).abs().max().item())
        generated = sum(len(s.response_ids) for s in samples)
        out[str(dtype)[6:]] = {"samples": len(samples), "tokens_per_s": generated / seconds,
                               "max_abs_logprob_diff_generate_vs_recompute": diff, "tolerance": tol,
                               "same_seed_same_tokens": same_seed, "ok": same_seed and (tol is None or diff <= tol)}
        del engine
    out["ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out


FUNCS = {"env": section_env, "head": section_head, "ops": section_ops, "megatron_hf": section_megatron_hf,
         "engine": section_engine, **gpu_check_paths.FUNCS, **gpu_check_hybrid.FUNCS}


# ---- driver ---------------------------------------------------------------------------------------------
def _print_section(name: str, res: dict) -> None:
    print(f"\n### {name}: {res['status']} ({res['seconds']:.1f} s)")
    if res["status"] != "ok":
        print("```\n" + res.get("error", "")[-1500:] + "\n```")
        return
    flat = []

    def walk(prefix, obj):
        for k, v in obj.items():
            if isinstance(v, dict):
                walk(f"{prefix}{k} / ", v)
            else:
                flat.append((prefix + k, v))
    walk("", res["result"])
    print("| what | value |\n|---|---|")
    for k, v in flat:
        print(f"| {k} | {v:.4g} |" if isinstance(v, float) and math.isfinite(v) else f"| {k} | {v} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="small sizes on CPU (CI)")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    default_out = os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else \
        str(ROOT / "bench_results" / "gpu_check.json")
    ap.add_argument("--out", default=default_out)
    ap.add_argument("--budget-s", type=float, default=420.0, help="sections not started by then are skipped")
    args = ap.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu", file=sys.stderr)
        return 2
    if args.cpu:  # Triton kernels run on CPU tensors under the interpreter (set before they are built)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    ctx = Ctx(args.cpu)
    start = time.perf_counter()
    report = {"mode": "cpu" if args.cpu else "gpu", "sections": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.sections.split(","):
        if time.perf_counter() - start > args.budget_s:
            res = {"status": "skipped (time budget)", "seconds": 0.0}
        else:
            t0 = time.perf_counter()
            try:
                result = FUNCS[name](ctx)
                status = "ok" if result.get("ok", True) else "out of tolerance"
                res = {"status": status, "result": result}
            except Exception:  # noqa: BLE001 - record it, run the next section
                res = {"status": "error", "error": traceback.format_exc()}
            res["seconds"] = time.perf_counter() - t0
            if not ctx.cpu:
                torch.cuda.empty_cache()
        report["sections"][name] = res
        out.write_text(json.dumps(report, indent=1, default=str))  # incremental: a cut run keeps its numbers
        _print_section(name, res)
    print(f"\nwrote {out} in {time.perf_counter() - start:.0f} s")
    return 0 if all(r["status"] == "ok" for r in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
