"""Vocab-parallel ops on 1, 2 and 4 gloo ranks vs the float64 single-process reference.

The vocabulary (197 real columns) is not divisible by the TP size, so the last shard carries padding
columns filled with junk that must never count; targets land in every shard.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_rl.ops import vocab_parallel_kl, vocab_parallel_stats
from multiproc import run_distributed
from ops_reference import pad_vocab, ref_kl, ref_stats

VOCAB = 197
ROWS = 40
CASES = [  # (dtype, temperature, min_p, chunk)
    (torch.float64, 1.0, None, None),
    (torch.float32, 0.8, 0.05, 7),
    (torch.bfloat16, 1.0, 0.2, 3),
    (torch.float32, 1.0, None, 1),
]


def _data(dtype, extreme=False):
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(ROWS, VOCAB, generator=g, dtype=torch.float64) * 4
    ref_logits = torch.randn(ROWS, VOCAB, generator=g, dtype=torch.float64) * 4
    targets = torch.arange(ROWS) * 5 % VOCAB  # spreads targets over every shard
    if extreme:
        logits[0] = -1e4
        logits[0, 150] = 1e4
        logits[1, :100] = -torch.inf  # rank 0's whole shard at TP=2 (and more at TP=4)
        ref_logits[1, :90] = -torch.inf  # both -inf there: KL terms 0 * (-inf - -inf) must vanish
        ref_logits[1, 90:100] = -1e4  # student -inf, reference finite: forward KL stays finite
        targets[1] = 120
        logits[2, 50:] = 1e4
    return logits.to(dtype), ref_logits.to(dtype), targets


def _weights(n, seed):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _worker(with_megatron: bool):
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    results = []
    for case_i, (dtype, temp, min_p, chunk) in enumerate(CASES + [(torch.float64, 1.0, 0.1, 4)]):
        extreme = case_i == len(CASES)
        logits, ref_logits, targets = _data(dtype, extreme)
        full = pad_vocab(logits, world, fill=1e3)  # junk padding larger than any real logit
        full_ref = pad_vocab(ref_logits, world, fill=-7.0)
        v_local = full.shape[-1] // world
        shard = full[:, rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
        shard_ref = full_ref[:, rank * v_local:(rank + 1) * v_local].clone()
        st = vocab_parallel_stats(shard, targets, tp_group=group, vocab_size=VOCAB, temperature=temp, min_p=min_p,
                                  chunk_size=chunk)
        kl, tv = vocab_parallel_kl(shard, shard_ref, tp_group=group, vocab_size=VOCAB, temperature=temp,
                                   chunk_size=chunk, with_tv=True)
        fkl = vocab_parallel_kl(shard, shard_ref, tp_group=group, vocab_size=VOCAB, direction="forward",
                                temperature=temp, chunk_size=chunk)
        loss = (st.logprobs.double() * _weights(ROWS, 0)).sum() + (st.entropy.double() * _weights(ROWS, 1)).sum()
        loss = loss + (kl.double() * _weights(ROWS, 3)).sum() + (fkl.double() * _weights(ROWS, 4)).sum()
        if min_p is not None:
            loss = loss + (st.pruned_logprobs.double() * _weights(ROWS, 2)).sum()
        (grad,) = torch.autograd.grad(loss, shard)
        out = {k: getattr(st, k) for k in ("logprobs", "entropy", "sum_pi_squared", "pruned_logprobs", "kept_mass",
                                           "target_kept") if getattr(st, k) is not None}
        out.update(kl=kl, tv=tv, fkl=fkl, grad=grad)
        results.append({k: v.detach() for k, v in out.items()})
    ce = None
    if with_megatron:
        ce = _megatron_ce_check(world, rank)
    return results, ce


def _megatron_ce_check(world, rank):
    """-logprobs and their gradient equal megatron-core's vocab_parallel_cross_entropy (no padding:
    Megatron's CE has no notion of padding columns)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_rl.parallel import ParallelLayout, init_megatron_parallel

    groups = init_megatron_parallel(ParallelLayout(tp=world))
    g = torch.Generator().manual_seed(5)
    v = 64 * world
    logits = torch.randn(6, 3, v, generator=g) * 3  # [s, b, V] as Megatron lays it out
    targets = torch.randint(0, v, (6, 3), generator=g)
    shard = logits[..., rank * 64:(rank + 1) * 64]
    a = shard.clone().requires_grad_()
    b = shard.clone().requires_grad_()
    ce = vocab_parallel_cross_entropy(a, targets)
    ours = -vocab_parallel_stats(b, targets, tp_group=groups.tp).logprobs
    w = torch.randn(6, 3, generator=g)
    (ga,) = torch.autograd.grad((ce * w).sum(), a)
    (gb,) = torch.autograd.grad((ours * w).sum(), b)
    return (ce - ours).abs().max().item(), (ga - gb).abs().max().item()


TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-5}
GRAD_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_sharded_ops_match_float64_reference(world):
    per_rank = run_distributed(_worker, world, world > 1, timeout_s=240)
    for case_i, (dtype, temp, min_p, _) in enumerate(CASES + [(torch.float64, 1.0, 0.1, 4)]):
        logits, ref_logits, targets = _data(dtype, case_i == len(CASES))
        xd = logits.double().requires_grad_()
        ref = ref_stats(xd, targets, VOCAB, temp, min_p)
        kl_ref, tv_ref = ref_kl(xd, ref_logits, VOCAB, "reverse", temp)
        fkl_ref, _ = ref_kl(xd, ref_logits, VOCAB, "forward", temp)
        ref.update(kl=kl_ref, tv=tv_ref, fkl=fkl_ref)
        loss = (ref["logprobs"] * _weights(ROWS, 0)).sum() + (ref["entropy"] * _weights(ROWS, 1)).sum()
        loss = loss + (kl_ref * _weights(ROWS, 3)).sum() + (fkl_ref * _weights(ROWS, 4)).sum()
        if min_p is not None:
            loss = loss + (ref["pruned_logprobs"] * _weights(ROWS, 2)).sum()
        (g_ref,) = torch.autograd.grad(loss, xd)
        results = [r[0][case_i] for r in per_rank]
        for k, v in results[0].items():
            if k == "grad":
                continue
            for r in results:  # every rank holds the same per-token result
                assert torch.equal(r[k], v), k
            if k == "target_kept":
                assert torch.equal(v, ref[k])
            else:
                torch.testing.assert_close(v.double(), ref[k].detach(), atol=TOL[dtype], rtol=TOL[dtype],
                                           msg=lambda m: f"case {case_i} {k}: {m}")
        grad = torch.cat([r["grad"] for r in results], -1)
        assert grad.dtype == dtype
        assert torch.all(grad[:, VOCAB:] == 0), "padding columns must get exactly zero gradient"
        torch.testing.assert_close(grad[:, :VOCAB].double(), g_ref, atol=GRAD_TOL[dtype], rtol=GRAD_TOL[dtype],
                                   msg=lambda m: f"case {case_i} grad: {m}")
    if world > 1:
        for _, (dv, dg) in per_rank:
            assert dv < 1e-5 and dg < 1e-6, (dv, dg)


def _mismatch_worker(kind):
    rank = dist.get_rank()
    logits = torch.zeros(4 if kind != "rows" or rank == 0 else 5, 10 if kind != "width" or rank == 0 else 12)
    targets = torch.zeros(logits.shape[0], dtype=torch.long)
    if kind == "targets" and rank == 1:
        targets[0] = 3
    try:
        vocab_parallel_stats(logits, targets, tp_group=dist.group.WORLD, vocab_size=18)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.timeout(120)
def test_inconsistent_shards_across_ranks_raise_on_every_rank():
    msgs = run_distributed(_mismatch_worker, 2, "width", timeout_s=60)
    assert all(m and "shard width V_local differs" in m for m in msgs), msgs
    msgs = run_distributed(_mismatch_worker, 2, "rows", timeout_s=60)
    assert all(m and "number of rows" in m for m in msgs), msgs
    msgs = run_distributed(_mismatch_worker, 2, "targets", timeout_s=60)
    assert all(m and "targets" in m for m in msgs), msgs
