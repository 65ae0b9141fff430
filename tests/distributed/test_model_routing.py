"""MoE routing record / replay: recorded ids equal HF's router top-k; replay forces given ids, reproduces
the natural forward and gradients exactly when given the natural ids, and lets gradients reach the
router weight; misaligned ids fail loudly. For Qwen3-MoE (softmax top-2) and DeepSeek-V3 (sigmoid scores +
expert bias, group-limited top-4, a shared expert that is never routed)."""

from __future__ import annotations

import pytest
import torch

from multiproc import run_distributed, tiny_hf_checkpoint

from model_helpers import hf_model, make_inputs

CASES = {  # model type, overrides, MoE layers
    "qwen3_moe": ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}, [0, 2]),  # layer 1 is dense
    "deepseek_v3": ("deepseek_v3", {}, [1, 2]),  # first_k_dense_replace=1
    "glm4_moe": ("glm4_moe", {}, [1, 2]),  # DeepSeek's router with 2 groups, top-1 group, top-2 experts
}


def _hf_topk(path, ids, moe_layers):
    """{layer: [s*b, topk]} chosen by HF's routers, sequence-major like Megatron."""
    from megatron_rl.models.router import tokens_from_batch_major

    model, seen = hf_model(path), {}
    for i in moe_layers:
        gate = model.model.layers[i].mlp.gate
        gate.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out[2]))
    with torch.no_grad():
        model(ids)
    b, s = ids.shape
    return {i: tokens_from_batch_major(seen[i].reshape(b, s, -1)) for i in moe_layers}


def _routing_child(path, ids, hf_ids, moe_layers):
    from megatron_rl import parallel
    from megatron_rl.models.build import build_model
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.models.router import moe_routers, record_routing, replay_routing

    out = {}
    b, s = ids.shape
    pos = torch.arange(s).expand(b, -1)
    weights = torch.randn(b, s, 256, generator=torch.Generator().manual_seed(7))
    for layout in (dict(ep=2), dict(tp=2, ep=2, etp=1)):
        groups = parallel.init_megatron_parallel(parallel.ParallelLayout(**layout))
        built = build_model(ModelConfig(hf_path=path), groups)
        model = built.module
        routers = dict(moe_routers(built))
        tp = built.shard.tp

        def run(ctx=None):
            """Forward + backward of a fixed linear loss; local logits and router grads."""
            model.zero_grad(set_to_none=True)
            logits = model(ids, pos, attention_mask=None)  # [b, s, V_pad/TP]
            cols = slice(tp.rank * logits.shape[-1], (tp.rank + 1) * logits.shape[-1])
            (logits * weights[..., cols]).sum().backward()
            return logits.detach(), {i: r.weight.grad.clone() for i, r in routers.items()}

        with record_routing(built) as rec:
            logits0, grads0 = run()
        recorded = rec.last()
        chosen = {}
        for i, r in routers.items():  # which experts the router's output actually used
            r.register_forward_hook(lambda m, a, o, i=i: chosen.__setitem__(i, o[1].detach().clone()))
        with replay_routing(built, recorded):
            logits1, grads1 = run()
        forced = {i: (t + 1) % built.arch.num_experts for i, t in recorded.items()}
        with replay_routing(built, forced):
            logits2, grads2 = run()
        local_forced = {i: t.chunk(tp.size)[tp.rank] if built.tconfig.sequence_parallel else t for i, t in forced.items()}
        errors = []
        topk = built.arch.moe_topk
        for bad in ({moe_layers[0]: recorded[moe_layers[0]]}, {i: t[:-2] for i, t in recorded.items()}):
            try:
                with replay_routing(built, bad):
                    model(ids, pos, attention_mask=None)
            except ValueError as e:
                errors.append(str(e))
        out[str(layout)] = {
            "layers": rec.layers,
            "recorded_equals_hf": all(
                torch.equal(recorded[i].sort(-1).values, hf_ids[i].sort(-1).values) for i in moe_layers
            ),
            "replay_same_logits": (logits1 - logits0).abs().max().item(),
            "replay_same_router_grads": max((grads1[i] - grads0[i]).abs().max().item() for i in routers),
            "forced_used": all(
                torch.equal(chosen[i].nonzero()[:, 1].view(-1, topk).sort(-1).values, local_forced[i].sort(-1).values)
                for i in routers
            ),
            "forced_changes_logits": (logits2 - logits0).abs().max().item(),
            "forced_router_grad_norm": min(grads2[i].norm().item() for i in routers),
            "errors": errors,
        }
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(CASES))
def test_record_and_replay_routing(tmp_path, case):
    model_type, overrides, moe_layers = CASES[case]
    path = tiny_hf_checkpoint(str(tmp_path / "moe"), model_type, **overrides)
    ids = make_inputs(250, seed=3)
    hf_ids = _hf_topk(path, ids, moe_layers)
    results = run_distributed(_routing_child, 2, path, ids, hf_ids, moe_layers, timeout_s=280)
    for rank, per_layout in enumerate(results):
        for layout, r in per_layout.items():
            where = f"rank {rank} {layout}"
            assert r["layers"] == moe_layers, where
            assert r["recorded_equals_hf"], where
            assert r["replay_same_logits"] == 0.0, (where, r)
            assert r["replay_same_router_grads"] <= 1e-7, (where, r)
            assert r["forced_used"], where
            assert r["forced_changes_logits"] > 1e-3, (where, r)
            assert 0.0 < r["forced_router_grad_norm"] < float("inf"), (where, r)
            assert len(r["errors"]) == 2, (where, r["errors"])
            assert f"no expert ids for MoE layer(s) {moe_layers[1:]}" in r["errors"][0]
            assert "22 tokens of expert ids but the model routes 24" in r["errors"][1]
