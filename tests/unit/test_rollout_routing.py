"""MoE routing capture: shape [response_tokens, layers, topk] and agreement with a full recomputation."""

import pytest
import torch

from megatron_rl.rollout.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
from megatron_rl.rollout.client.protocol import GenerateRequest, SamplingParams
from megatron_rl.rollout.embedded.routing import RoutingRecorder

from rollout_models import tiny_qwen3, tiny_qwen3_moe


@pytest.fixture(scope="module")
def moe():
    return tiny_qwen3_moe()


def _full_routing(model, ids):
    """``[len(ids), L, K]`` expert ids from one unpadded forward over the whole sequence."""
    rec = RoutingRecorder(model)
    rec.enabled = True
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    layers = rec.pop()
    rec.remove()
    return torch.stack(layers, dim=1)


def _requests():
    # different prompt lengths so left padding is exercised
    return [GenerateRequest((1, 2, 3), SamplingParams(max_new_tokens=9, seed=1, ignore_eos=True),
                            return_routed_experts=True),
            GenerateRequest(tuple(range(10, 21)), SamplingParams(max_new_tokens=5, seed=2, n=2, ignore_eos=True),
                            return_routed_experts=True)]


def test_routing_shape_and_agreement_with_recomputation(moe):
    engine = EmbeddedEngine(moe)
    L, K = engine.routing.num_layers, engine.routing.top_k
    assert (L, K) == (3, 2)
    for s in engine.generate(_requests()):
        R, P = len(s.response_ids), len(s.prompt_ids)
        assert s.routed_experts.shape == (R, L, K) and s.routed_experts.dtype == torch.int32
        assert s.prompt_routed_experts.shape == (P, L, K)
        full = _full_routing(moe, s.prompt_ids + s.response_ids)
        # compare as sets per (token, layer): the top-k order of near-equal scores is not meaningful
        got = torch.cat([s.prompt_routed_experts, s.routed_experts]).sort(-1).values
        assert torch.equal(got, full.sort(-1).values)


def test_without_the_extra_step_the_last_row_is_marked(moe):
    engine = EmbeddedEngine(moe, EmbeddedEngineConfig(fill_last_routing=False))
    s = engine.generate(_requests()[:1])[0]
    assert (s.routed_experts[-1] == -1).all()
    full = _full_routing(moe, s.prompt_ids + s.response_ids)
    assert torch.equal(s.routed_experts[:-1].sort(-1).values, full[len(s.prompt_ids):-1].sort(-1).values)


def test_requests_without_routing_get_none_and_dense_models_refuse(moe):
    engine = EmbeddedEngine(moe)
    s = engine.generate([GenerateRequest((1, 2), SamplingParams(max_new_tokens=3))])[0]
    assert s.routed_experts is None and s.prompt_routed_experts is None
    with pytest.raises(ValueError, match="no sparse-MoE layers"):
        EmbeddedEngine(tiny_qwen3()).generate([GenerateRequest((1,), return_routed_experts=True)])
