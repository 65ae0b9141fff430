"""Objectives split across 2 gloo ranks equal the unsplit single-process computation.

* context-parallel style: every rank holds the zigzag chunks of the *same* sequences (``groups.cp``);
* data-parallel style with micro-batches: ranks hold different sequences, each rank two micro-batches
  sharing the step normaliser (``groups.dp``).

Same masks, the per-rank losses add up to the unsplit loss, the gradients are the corresponding slices
of the unsplit gradients, and the metrics are identical. Also: the CP sequence scan (future-KL
cost-to-go) and the LR schedule (identical on every rank from a global response length).
"""

import pytest
import torch
import torch.distributed as dist

from megatron_rl.objectives import (
    ReduceGroups, future_kl_cost_to_go, rl_loss, select_tokens, step_normalizer,
)
from megatron_rl.objectives.reduce import broadcast_scalar, global_mean_response_length, zigzag_split
from megatron_rl.lr_schedules import LRSchedule, LRScheduleConfig
from multiproc import run_distributed
from objectives_fixtures import CONFIGS, GRAD_FIELDS, make_inputs, random_batch, rows

WORLD = 2
DP_ROWS = [slice(0, 3), slice(3, 8)]  # uneven DP split; each rank further splits into 2 micro-batches


def _grads(inp):
    return {k: getattr(inp, k).grad for k in GRAD_FIELDS}


def _metrics(m):
    return {k: float(v) for k, v in m.items()}


def _cp_side(d, rank):
    """Zigzag slices along T of every [B, T] field."""
    return {k: zigzag_split(v, WORLD, rank) for k, v in d.items()}


def _worker(batches):
    rank = dist.get_rank()
    world = dist.group.WORLD
    out = {"cp": [], "dp": []}
    for d in batches:
        for _, cfg in CONFIGS:
            # context parallel
            inp = make_inputs(_cp_side(d, rank))
            loss, m = rl_loss(inp, cfg, ReduceGroups(cp=world))
            loss.backward()
            keep = select_tokens(make_inputs(_cp_side(d, rank), False), cfg, ReduceGroups(cp=world)).keep
            out["cp"].append((loss.item(), _grads(inp), keep, _metrics(m)))
            # data parallel, two micro-batches per rank; each rank trims its padding columns, so the
            # ranks' padded lengths differ
            mine = rows(d, DP_ROWS[rank])
            T = mine["mask"].shape[1]
            span = int(mine["mask"].any(0).nonzero().max()) + 1
            mine = {k: v[:, :span] for k, v in mine.items()}
            n = mine["mask"].shape[0]
            mbs = [rows(mine, slice(0, n // 2)), rows(mine, slice(n // 2, n))]
            groups = ReduceGroups(dp=world)
            norm = step_normalizer([make_inputs(mb, False) for mb in mbs], cfg, groups)
            total, grads, metrics = 0.0, [], []
            for mb in mbs:
                inp = make_inputs(mb)
                loss, m = rl_loss(inp, cfg, groups, normalizer=norm)
                loss.backward()
                total += loss.item()
                grads.append({k: None if g is None else torch.nn.functional.pad(g, (0, T - span))
                              for k, g in _grads(inp).items()})
                metrics.append(_metrics(m))
            # one micro-batch per rank: the metrics are those of the whole step
            _, m_step = rl_loss(make_inputs(mine), cfg, groups)
            out["dp"].append((total, grads, metrics, _metrics(m_step)))
    # sequence-order scan under CP: the future-KL cost-to-go
    d = batches[0]
    kl = torch.where(d["mask"], d["ref_kl"], 0.0)
    local = _cp_side({"kl": kl, "mask": d["mask"]}, rank)
    out["cost_to_go"] = future_kl_cost_to_go(local["kl"], local["mask"], 0.3, cp_group=world)
    # LR identical on every rank from the global mean response length (ranks see different lengths)
    sched = LRSchedule(LRScheduleConfig(kind="length_surge", lr=1.0, baseline_steps=3, warmup_steps=2))
    lrs, lens = [], []
    for step in range(12):
        mask = torch.zeros(4, 64, dtype=torch.bool)
        mask[:, : (10 + 3 * rank + (40 if step >= 6 else 0))] = True
        lens.append(global_mean_response_length(mask, dp_group=world))
        lrs.append(broadcast_scalar(sched.step(lens[-1]), world))
    out["lr"] = (lrs, lens, sched.state_dict())
    return out


def _assert_metrics_equal(got, ref, what):
    assert set(got) == set(ref), (what, set(got) ^ set(ref))
    for k in ref:
        assert got[k] == pytest.approx(ref[k], rel=1e-9, abs=1e-12), (what, k)


def test_cp_dp_and_micro_batch_invariance():
    batches = [random_batch(seed=20), random_batch(seed=21)]
    results = run_distributed(_worker, WORLD, batches, timeout_s=240)
    i = 0
    for d in batches:
        rejecting = 0
        for name, cfg in CONFIGS:
            full = make_inputs(d)
            loss, m = rl_loss(full, cfg)
            loss.backward()
            ref_m = _metrics(m)
            ref_keep = select_tokens(make_inputs(d, False), cfg).keep
            rejecting += bool((ref_keep != select_tokens(make_inputs(d, False), cfg).valid).any())
            # context parallel
            cp_loss = sum(r["cp"][i][0] for r in results)
            assert cp_loss == pytest.approx(loss.item(), abs=1e-12), name
            for rank, r in enumerate(results):
                _, grads, keep, metrics = r["cp"][i]
                assert torch.equal(keep, zigzag_split(ref_keep, WORLD, rank)), name
                for k in GRAD_FIELDS:
                    g_ref = getattr(full, k).grad
                    if g_ref is None:
                        assert grads[k] is None
                    else:
                        torch.testing.assert_close(grads[k], zigzag_split(g_ref, WORLD, rank), atol=1e-13, rtol=1e-11)
                _assert_metrics_equal(metrics, ref_m, f"cp {name}")
            # data parallel + micro-batches
            assert sum(r["dp"][i][0] for r in results) == pytest.approx(loss.item(), abs=1e-12), name
            for k in GRAD_FIELDS:
                g_ref = getattr(full, k).grad
                if g_ref is None:
                    continue
                got = torch.cat([g[k] for r in results for g in r["dp"][i][1]])
                torch.testing.assert_close(got, g_ref, atol=1e-13, rtol=1e-11)
            # a micro-batch's metrics cover that micro-batch of every DP rank: their loss totals add up
            # to the step's loss
            for r in results:
                assert sum(mm["loss/total"] for mm in r["dp"][i][2]) == pytest.approx(loss.item(), abs=1e-12)
                _assert_metrics_equal(r["dp"][i][3], ref_m, f"dp {name}")
            i += 1
        assert rejecting >= 3  # the batches exercise rejection under most configurations

    d = batches[0]
    kl = torch.where(d["mask"], d["ref_kl"], 0.0)
    ref_c = future_kl_cost_to_go(kl, d["mask"], 0.3)
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["cost_to_go"], zigzag_split(ref_c, WORLD, rank))

    (lr0, len0, sd0), (lr1, len1, sd1) = results[0]["lr"], results[1]["lr"]
    assert lr0 == lr1 and len0 == len1 and sd0 == sd1
    assert len0[0] == pytest.approx(11.5) and len0[-1] == pytest.approx(51.5)
    assert sd0["state"]["surge_step"] == 6 and lr0[5] == 1.0 and lr0[-1] == 1.0  # P = ⌈1.8·6⌉ = 11
