"""The fused output layer on 1, 2 and 4 gloo ranks vs float64 single-process references.

``vocab_parallel_linear_stats`` / ``vocab_parallel_linear_kl`` take the hidden states (identical on every
rank) and this rank's rows of the padded output weight. The vocabulary (197 real columns) is not
divisible by the TP size, so the last shard holds padding rows with junk weights that must never count
(and get exactly zero gradient). The hidden-state gradient of each rank is its shard's part: summed over
ranks it must equal the full gradient, as Megatron's input region all-reduce makes it.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_rl.ops import (vocab_parallel_kl, vocab_parallel_linear_kl, vocab_parallel_linear_stats,
                             vocab_parallel_stats)
from multiproc import run_distributed
from ops_reference import ref_kl, ref_stats

VOCAB, ROWS, HID, REF_HID = 197, 40, 12, 9
CASES = [  # (dtype, temperature, min_p, chunk): chunk = rows per logits block
    (torch.float64, 1.0, None, None),
    (torch.float64, 0.7, 0.05, 7),
    (torch.float64, 1.3, 0.3, 1),
    (torch.float32, 0.9, 0.1, 16),
]


def _data(dtype, world):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, ROWS // 2, HID, generator=g, dtype=torch.float64)
    weight = torch.randn(VOCAB, HID, generator=g, dtype=torch.float64)
    ref_hidden = torch.randn(2, ROWS // 2, REF_HID, generator=g, dtype=torch.float64)
    ref_weight = torch.randn(VOCAB, REF_HID, generator=g, dtype=torch.float64)
    targets = (torch.arange(ROWS) * 5 % VOCAB).view(2, ROWS // 2)  # every shard owns some targets
    padded = -(-VOCAB // world) * world
    junk = torch.full((padded - VOCAB, HID), 50.0, dtype=torch.float64)  # would dominate any softmax
    junk_ref = torch.full((padded - VOCAB, REF_HID), -30.0, dtype=torch.float64)
    return (hidden.to(dtype), torch.cat([weight, junk]).to(dtype), ref_hidden.to(dtype),
            torch.cat([ref_weight, junk_ref]).to(dtype), targets)


def _w(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _loss(st, kl, fkl, min_p):
    shape = st.logprobs.shape
    loss = (st.logprobs.double() * _w(shape, 0)).sum() + (st.entropy.double() * _w(shape, 1)).sum()
    loss = loss + (kl.double() * _w(kl.shape, 3)).sum() + (fkl.double() * _w(kl.shape, 4)).sum()
    if min_p is not None:
        loss = loss + (st.pruned_logprobs.double() * _w(st.logprobs.shape, 2)).sum()
    return loss


def _worker():
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    out = []
    for dtype, temp, min_p, chunk in CASES:
        hidden, weight, ref_hidden, ref_weight, targets = _data(dtype, world)
        v_local = weight.shape[0] // world
        h = hidden.clone().requires_grad_()
        w = weight[rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
        wr = ref_weight[rank * v_local:(rank + 1) * v_local]
        kw = dict(tp_group=group, vocab_size=VOCAB, temperature=temp, chunk_size=chunk)
        st = vocab_parallel_linear_stats(h, w, targets, min_p=min_p, **kw)
        kl, tv = vocab_parallel_linear_kl(h, w, ref_hidden, wr, with_tv=True, **kw)
        fkl = vocab_parallel_linear_kl(h, w, ref_hidden, wr, direction="forward", **kw)
        gh, gw = torch.autograd.grad(_loss(st, kl, fkl, min_p), (h, w))
        res = {k: getattr(st, k) for k in ("logprobs", "entropy", "sum_pi_squared", "pruned_logprobs", "kept_mass",
                                           "target_kept") if getattr(st, k) is not None}
        res.update(kl=kl, tv=tv, fkl=fkl, gh=gh, gw=gw)
        out.append({k: v.detach() for k, v in res.items()})
    return out


TOL = {torch.float64: 1e-10, torch.float32: 2e-5}
GRAD_TOL = {torch.float64: 1e-10, torch.float32: 5e-5}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_fused_head_matches_float64_reference(world):
    per_rank = run_distributed(_worker, world, timeout_s=240)
    for case_i, (dtype, temp, min_p, _) in enumerate(CASES):
        hidden, weight, ref_hidden, ref_weight, targets = _data(torch.float64, world)
        hd, wd = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logits = hd @ wd.T
        ref = ref_stats(logits, targets, VOCAB, temp, min_p)
        ref_logits = ref_hidden @ ref_weight.T
        ref["kl"], ref["tv"] = ref_kl(logits, ref_logits, VOCAB, "reverse", temp)
        ref["fkl"], _ = ref_kl(logits, ref_logits, VOCAB, "forward", temp)
        gh_ref, gw_ref = torch.autograd.grad(_loss(_Obj(ref), ref["kl"], ref["fkl"], min_p), (hd, wd))
        results = [r[case_i] for r in per_rank]
        for k, v in results[0].items():
            if k in ("gh", "gw"):
                continue
            for r in results:  # every rank holds the same per-token result
                assert torch.equal(r[k], v), k
            if k == "target_kept":
                assert torch.equal(v, ref[k])
            else:
                torch.testing.assert_close(v.double(), ref[k].detach(), atol=TOL[dtype], rtol=TOL[dtype],
                                           msg=lambda m: f"case {case_i} {k}: {m}")
        gh = sum(r["gh"].double() for r in results)  # the TP all-reduce of the input region
        gw = torch.cat([r["gw"] for r in results])
        assert gw.dtype == dtype and results[0]["gh"].dtype == dtype
        assert torch.all(gw[VOCAB:] == 0), "padding rows of the weight must get exactly zero gradient"
        torch.testing.assert_close(gh, gh_ref, atol=GRAD_TOL[dtype], rtol=GRAD_TOL[dtype],
                                   msg=lambda m: f"case {case_i} dhidden: {m}")
        torch.testing.assert_close(gw[:VOCAB].double(), gw_ref[:VOCAB], atol=GRAD_TOL[dtype], rtol=GRAD_TOL[dtype],
                                   msg=lambda m: f"case {case_i} dweight: {m}")


class _Obj:
    def __init__(self, d):
        self.__dict__.update(d)
        self.pruned_logprobs = d.get("pruned_logprobs")


def _uneven_padding_worker():
    """Shards of width 1000 where the last rank holds 300 real columns: a default chunk derived from the
    real width would differ across ranks (1 chunk there, 2 here) and mismatch the collectives."""
    rank = dist.get_rank()
    rows, v_local, vocab = 6000, 1000, 1300
    g = torch.Generator().manual_seed(rank)
    targets = torch.arange(rows) % vocab
    kw = dict(tp_group=dist.group.WORLD, vocab_size=vocab)
    h = torch.randn(rows, 4, generator=torch.Generator().manual_seed(9))
    fused = vocab_parallel_linear_stats(h, torch.randn(v_local, 4, generator=g), targets, **kw).logprobs.sum()
    x = torch.randn(rows, v_local, generator=g)
    return fused, vocab_parallel_stats(x, targets, **kw).logprobs.sum(), vocab_parallel_kl(x, x + 1, **kw).sum()


@pytest.mark.timeout(200)
def test_default_chunks_agree_across_ranks_with_uneven_padding():
    a, b = run_distributed(_uneven_padding_worker, 2, timeout_s=120)
    for u, v in zip(a, b):
        assert torch.isfinite(u) and torch.equal(u, v)
