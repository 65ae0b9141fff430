"""Routing replay on a tiny DeepSeek-V3-style model (MLA, dense layer 0, two MoE layers of 8 experts with a
shared expert, sigmoid scores + score bias, group-limited top-4): the embedded engine (HF's DeepseekV3 with
perturbed router weights, so it routes differently from the trainer) samples with routing capture; the
trainer replays the engine's experts with the router's own semantics (ids from the biased scores, weights
from the unbiased sigmoid scores, renormalised and scaled; the shared expert is never routed).

Checks: without replay the trainer's routers disagree with the engine's and the log-probs differ; with
replay the mismatch drops; the replayed log-probs, loss and grad norm are the same for packed and padded
micro-batches (pad positions, routed to placeholder experts in the dropless MoE, cannot displace a real
token's routing or change its log-prob), under EP=2,
and under TP=2 with sequence parallelism (each rank replays its slice of the ids); every routed position of
the batch is replayed once per MoE layer. The same for a tiny GLM-4.5-style model (the same router with 2 groups,
top-1 group, top-2 experts; GQA attention with q/k/v bias, q/k norm and partial RoPE).
"""

from __future__ import annotations

import pytest
import torch

from multiproc import run_distributed, tiny_hf_checkpoint

from test_routing_replay import _engine_batch, _layout_child


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model_type,topk", [("deepseek_v3", 4), ("glm4_moe", 2)])
def test_deepseek_replay_padded_packed_ep_tp(tmp_path, model_type, topk):
    path = tiny_hf_checkpoint(str(tmp_path / model_type), model_type)
    batch = _engine_batch(path, "perturbed", n=8)
    cases = [("packed", {}, dict(micro_batch_size=4)),
             ("padded", {}, dict(micro_batch_size=4, packing=False)),
             ("ep2", dict(ep=2), dict(micro_batch_size=2)),
             ("tp2_sp", dict(tp=2, ep=2, etp=1), dict(micro_batch_size=2))]
    results = run_distributed(_layout_child, 2, path, batch, cases, timeout_s=280)

    def full_logprobs(name):
        parts = {r[name]["rows"]: r[name]["logprobs"] for r in results}
        return torch.cat([parts[i] for i in sorted(parts)])

    base = results[0]["packed"]
    m = base["metrics"]
    print(f"\n{model_type} replay:", {k: round(v, 5) for k, v in sorted(m.items())})
    assert m["routing/no_replay/agreement_mean"] < 1.0
    assert m["routing/logprob_abs_diff"] < m["routing/no_replay/logprob_abs_diff"]
    for name, _, _ in cases[1:]:
        run = results[0][name]
        assert torch.allclose(full_logprobs(name), full_logprobs("packed"), atol=1e-5, rtol=0), name
        assert run["loss"] == pytest.approx(base["loss"], rel=1e-5, abs=1e-6), name
        assert run["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-5), name
        for k, v in m.items():
            if name == "padded" and k == "routing/replayed_tokens":
                # padded rows carry valid placeholder ids (training/micro_batch.py), counted as replayed; the
                # MoE is dropless, so they cannot evict a real token (log-probs, loss and grads equal above)
                assert run["metrics"][k] > v, k
                continue
            assert run["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-7), (name, k)
    from megatron_rl.routing import FREE

    routed = batch.routed_experts[..., 0] != FREE  # [B, S, MoE layers]
    assert routed.shape[-1] == 2 and batch.routed_experts.shape[-1] == topk
    assert m["routing/replayed_tokens"] == routed.sum().item() / routed.shape[-1] > 0
