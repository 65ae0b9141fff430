"""The embedded engine under the CPU placement guard (tests/device_guard.py): generation (plain, filtered,
greedy and mixed batches, top log-probs, n > 1, routed experts), prompt log-probs and a weight update run
as a CUDA run would place them; a seed gives the same tokens with and without the guard (the per-row
generators stay on the host: one batched draw per decode step, moved once); answers land on the host."""

import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.rollout.embedded.engine import EmbeddedEngine
from megatron_rl.rollout.client.protocol import GenerateRequest, SamplingParams

from rollout_models import other_weights, tiny_qwen3, tiny_qwen3_moe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from device_guard import DeviceGuard, PlacementError  # noqa: E402


def _requests(routes: bool = False):
    kinds = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8), dict(temperature=0.0),
             dict(temperature=1.2, top_k=5, min_p=0.02)]
    return [GenerateRequest(tuple(range(3 + i, 9 + 2 * i)), SamplingParams(max_new_tokens=12, seed=i, n=2,
                                                                             ignore_eos=True, **kw),
                            return_top_logprobs=2, return_routed_experts=routes) for i, kw in enumerate(kinds)]


def _run(model, guarded: bool, routes: bool):
    guard = DeviceGuard()
    if not guarded:
        return EmbeddedEngine(model).generate(_requests(routes)), None, guard
    with guard:
        guard.place(model)
        engine = EmbeddedEngine(model)
        samples = engine.generate(_requests(routes))
        scored = (engine.prompt_logprobs_and_routes(list(range(2, 12))) if routes
                  else engine.prompt_logprobs(list(range(2, 12))))
        engine.update_weights([other_weights(tiny_qwen3_moe if routes else tiny_qwen3, seed=5)], version=1)
        again = engine.generate(_requests(routes)[:1])
        assert len(again) == 2
    return samples, scored, guard


@pytest.mark.parametrize("moe", [False, True])
def test_engine_generates_under_the_placement_guard(moe):
    model = tiny_qwen3_moe() if moe else tiny_qwen3()
    ref, _, _ = _run(model, False, moe)
    got, scored, guard = _run(model, True, moe)
    assert [s.response_ids for s in got] == [s.response_ids for s in ref]  # same seeds, same tokens
    for a, b in zip(got, ref):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6)
        for t in (a.top_logprob_ids, a.top_logprob_values, a.routed_experts, a.prompt_routed_experts):
            assert t is None or not guard.is_device(t)  # answers are on the host
        if moe:
            assert torch.equal(a.routed_experts, b.routed_experts)
    for t in (scored[0] if moe else scored):
        assert not guard.is_device(t)


def test_guard_raises_on_a_host_tensor_meeting_a_device_tensor():
    with DeviceGuard() as guard:
        w = torch.randn(4, 3)
        guard.place(w)
        assert guard.is_device(w @ torch.randn(3, 2).to(w.device))
        assert guard.is_device(w * torch.tensor(2.0))  # a 0-dim host tensor is a scalar, as on CUDA
        with pytest.raises(PlacementError, match="mixes a device tensor with host"):
            w + torch.ones(4, 3)
