"""The Triton row kernels of the fused output layer, on CPU under Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before the kernels are built (they are built lazily, on first use),
so this module sets it at import. Compared with the torch row passes: the per-row forward record and
the logit gradient (with ``-inf`` logits, padding, min-p and temperature), and the whole fused op through
``backend="triton"``. The kernels are also compiled for Hopper (sm_90) with Triton's own ``ptxas``, which
needs no GPU: what cannot be checked here is only their speed.
"""

import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from megatron_rl.ops import _shard as sh  # noqa: E402
from megatron_rl.ops import stats as stm  # noqa: E402
from megatron_rl.ops import triton_head  # noqa: E402
from megatron_rl.ops import vocab_parallel_linear_stats  # noqa: E402

if triton_head._kernels.cache_info().currsize:  # built before TRITON_INTERPRET was set: cannot run on CPU
    pytest.skip("Triton kernels were already built without the interpreter in this process", allow_module_level=True)


def _block(dtype, rows=9, nv=1500, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, nv, generator=g) * 4).to(dtype)
    x[1, :700] = -torch.inf  # a row part at -inf (a masked region)
    x[2] = -torch.inf  # this shard holds none of row 2's mass (another rank does)
    x[3, 17] = 60.0  # one dominating logit
    y = torch.randint(0, nv + 200, (rows,), generator=g)  # some targets on "another rank"
    return x, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,min_p", [(1.0, None), (0.7, 0.05)])
def test_row_kernels_match_torch_row_passes(dtype, temperature, min_p):
    x, y = _block(dtype)
    rows, nv = x.shape
    shard = sh.Shard(None, 1, 0, nv + 200, nv + 200)  # pretend 200 more columns live elsewhere
    owned = y < nv
    y_loc = torch.where(owned, y, 0)
    thr = stm.min_p_threshold(min_p, torch.float32)
    n = 7 if thr is not None else 5
    rec_t, rec_k = torch.zeros(n, rows), torch.zeros(n, rows)
    bufs = stm.RowBuffers(4, nv, torch.float32, "cpu")
    neginf = stm.forward_rows(x, y_loc, owned, shard, temperature, thr, bufs, rec_t)
    triton_head.forward_rows(x, torch.where(owned, y, -1), shard, temperature, thr, rec_k)
    finite = torch.isfinite(rec_t[stm.M])
    torch.testing.assert_close(rec_k[:, finite], rec_t[:, finite], atol=1e-5, rtol=1e-5)
    assert torch.equal(rec_k[stm.S, 2], rec_t[stm.S, 2])  # row 2: no mass here, S == 0 exactly

    _, saved = stm.finish_forward(rec_t, thr)
    gen = torch.Generator().manual_seed(5)
    g_lp, g_h = torch.randn(rows, generator=gen), torch.randn(rows, generator=gen)
    g_pl = torch.randn(rows, generator=gen) if thr is not None else None
    coef = stm.grad_coefficients(saved, owned, g_lp, g_h, g_pl, torch.float32)
    keep = rec_t[stm.S] > 0  # row 2 has no mass on any "rank" here: no gradient to compare
    coef = tuple(None if c is None else torch.where(keep, c, torch.zeros_like(c)) for c in coef)
    out_t, out_k = torch.empty_like(x), x.clone()  # the kernel writes over its input, as the op does
    stm.grad_rows(x, out_t, y_loc, rec_t[stm.M], coef, temperature, thr, neginf, bufs)
    triton_head.grad_rows(out_k, out_k, torch.where(owned, y, -1), rec_t[stm.M], coef, temperature, thr)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out_k.float(), out_t.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_op_triton_backend_matches_torch_backend(dtype):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 6, 8, generator=g).to(dtype)
    w = torch.randn(1100, 8, generator=g).to(dtype)
    y = torch.randint(0, 1090, (2, 6), generator=g)
    res = {}
    for backend in ("torch", "triton"):
        h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
        st = vocab_parallel_linear_stats(h1, w1, y, vocab_size=1090, temperature=0.8, min_p=0.02, chunk_size=5,
                                         backend=backend)
        loss = (st.logprobs * 0.7 + st.entropy * 0.2 + st.pruned_logprobs * 0.5).sum()
        res[backend] = (st, torch.autograd.grad(loss, (h1, w1)))
    (a, ga), (b, gb) = res["torch"], res["triton"]
    for k in ("logprobs", "entropy", "sum_pi_squared", "pruned_logprobs", "kept_mass"):
        torch.testing.assert_close(getattr(b, k), getattr(a, k), atol=2e-5, rtol=2e-5, msg=k)
    assert torch.equal(a.target_kept, b.target_kept)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for u, v in zip(gb, ga):
        torch.testing.assert_close(u.float(), v.float(), atol=tol * v.float().abs().max().item(), rtol=tol)
    assert torch.all(gb[1][1090:] == 0)


_COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megatron_rl.ops import triton_head

stats_fwd, kept_fwd, grad = triton_head._kernels()
common = {"stride_x": "i64", "n_cols": "i32", "y_ptr": "*i64", "temperature": "fp32", "BLOCK": "constexpr"}
n = 0
for dt in ("bf16", "fp32"):
    sigs = [
        (stats_fwd, {"x_ptr": f"*{dt}", **common, "out_ptr": "*fp32", "n_rows": "i32"}, {}),
        (kept_fwd, {"x_ptr": f"*{dt}", **common, "m_ptr": "*fp32", "out_ptr": "*fp32", "n_rows": "i32",
                    "thr": "fp32"}, {}),
    ]
    grad_sig = {"x_ptr": f"*{dt}", **common, "g_ptr": f"*{dt}", "stride_g": "i64", "m_ptr": "*fp32",
                "a_ptr": "*fp32", "b_ptr": "*fp32", "c_ptr": "*fp32", "d_ptr": "*fp32", "thr": "fp32",
                "HAS_BETA": "constexpr", "HAS_GAMMA": "constexpr"}
    sigs += [(grad, grad_sig, {"HAS_BETA": b, "HAS_GAMMA": c}) for b in (False, True) for c in (False, True)]
    for fn, sig, ce in sigs:
        src = ASTSource(fn=fn, signature=sig, constexprs={"BLOCK": triton_head._BLOCK, **ce})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        assert k.asm["cubin"], fn
        n += 1
print(n)
"""


def test_kernels_compile_for_hopper():
    """The kernels compile to sm_90 cubins (ptxas included), in a process without the interpreter: under
    TRITON_INTERPRET=1 triton's language functions are the interpreter's, which its compiler cannot take."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "12"  # 2 dtypes x (stats, kept, 4 gradient variants)
