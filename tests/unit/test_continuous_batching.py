"""Continuous batching in the embedded engine: rows join a running batch between decode steps and leave when
finished; what each row generates is what it generates alone (tokens exactly, log-probs and routes against a
full recomputation), and a request arriving during a long generation is answered before it ends."""

import threading
import time

import pytest
import torch

from megatron_rl.rollout.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
from megatron_rl.rollout.client.protocol import GenerateRequest, SamplingParams

from rollout_models import recompute_logits, tiny_qwen3, tiny_qwen3_moe
from test_rollout_routing import _full_routing


def _requests(routes=False):
    """Different prompt lengths (left padding on both sides of a join) and lengths (rows leave at many steps)."""
    lengths = [(3, 17), (11, 4), (1, 9), (7, 2), (5, 12), (2, 6), (9, 1)]
    return [GenerateRequest(tuple(range(3 + i, 3 + i + p)), SamplingParams(max_new_tokens=m, seed=i, n=1 + i % 2),
                            return_routed_experts=routes)
            for i, (p, m) in enumerate(lengths)]


def _joins(engine):
    """Wraps the engine's batch so each test can see that rows really joined a running batch."""
    sizes = []
    join = engine._join

    def recorded(batch, rows):
        sizes.append((len(batch), len(rows)))
        return join(batch, rows)

    engine._join = recorded
    return sizes


@pytest.mark.parametrize("max_rows", [2, 3])
def test_rows_joining_a_running_batch_sample_what_they_sample_alone(max_rows):
    model = tiny_qwen3(0)
    engine = EmbeddedEngine(model, EmbeddedEngineConfig(max_batch_rows=max_rows))
    joins = _joins(engine)
    together = engine.generate(_requests())
    assert any(running > 0 for running, _ in joins), joins  # rows joined a batch that was decoding
    alone = [s for r in _requests() for s in EmbeddedEngine(model, EmbeddedEngineConfig(max_batch_rows=1))
             .generate([r])]
    assert [s.response_ids for s in together] == [s.response_ids for s in alone]
    for s in together:
        logits = recompute_logits(model, s.prompt_ids, s.response_ids)
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.response_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(s.logprobs), want, atol=1e-5)


def test_rows_are_built_only_as_places_free_up():
    """A request of many samples costs memory per batch, not per request: rows are pulled from the request as
    places in the batch free up (a list of all rows first held every row before the first forward)."""
    engine = EmbeddedEngine(tiny_qwen3(0), EmbeddedEngineConfig(max_batch_rows=4))
    built, at_join = [0], []
    rows = engine.rows

    def counted(req):
        for row in rows(req):
            built[0] += 1
            yield row
    engine.rows = counted
    join = engine._join
    engine._join = lambda batch, new: (at_join.append(built[0]), join(batch, new))[1]
    samples = engine.generate([GenerateRequest((3, 4), SamplingParams(n=200, max_new_tokens=1, seed=1))])
    assert len(samples) == 200 and [s.sample_index for s in samples] == list(range(200))
    assert at_join[0] == 4 and all(n - i * 4 <= 4 for i, n in enumerate(at_join))


def test_routes_of_rows_that_joined_mid_batch():
    moe = tiny_qwen3_moe()
    engine = EmbeddedEngine(moe, EmbeddedEngineConfig(max_batch_rows=3))
    joins = _joins(engine)
    samples = engine.generate(_requests(routes=True))
    assert any(running > 0 for running, _ in joins)
    for s in samples:
        full = _full_routing(moe, s.prompt_ids + s.response_ids)
        got = torch.cat([s.prompt_routed_experts, s.routed_experts])
        assert torch.equal(got.sort(-1).values, full.sort(-1).values)


def test_a_request_arriving_during_a_long_generation_is_answered_before_it_ends():
    from megatron_rl.rollout.embedded.generation_queue import GenerationQueue

    engine = EmbeddedEngine(tiny_qwen3(0, 1024))
    queue = GenerationQueue(engine)
    try:
        out = {}
        long = threading.Thread(target=lambda: out.update(long=queue.submit(
            [GenerateRequest((1, 2), SamplingParams(max_new_tokens=600, ignore_eos=True))])))
        long.start()
        while not engine.live_tokens() or max(engine.live_tokens()) < 5:
            time.sleep(0.005)
        short = queue.submit([GenerateRequest((4,), SamplingParams(max_new_tokens=3, ignore_eos=True))])
        assert long.is_alive() and max(engine.live_tokens()) < 600  # answered while the long one decodes
        assert len(short[0].response_ids) == 3
        long.join(120)
        assert len(out["long"][0].response_ids) == 600
    finally:
        queue.stop()


def test_an_update_waits_for_the_running_rows_and_stops_new_ones_joining():
    """SGLang's writer-preferring model-update lock: a weight update (not paused) waits for the running batch to
    finish, rows queued meanwhile start after it, on the new version."""
    from megatron_rl.rollout.embedded.generation_queue import GenerationQueue

    model = tiny_qwen3(0, 1024)
    engine = EmbeddedEngine(model, EmbeddedEngineConfig(max_batch_rows=1))
    queue = GenerationQueue(engine)
    try:
        out = {}
        first = threading.Thread(target=lambda: out.update(first=queue.submit(
            [GenerateRequest((1, 2), SamplingParams(max_new_tokens=200, ignore_eos=True))])))
        first.start()
        while not engine.live_tokens():
            time.sleep(0.005)
        second = threading.Thread(target=lambda: out.update(second=queue.submit(
            [GenerateRequest((3,), SamplingParams(max_new_tokens=2, ignore_eos=True))])))
        second.start()
        time.sleep(0.05)
        engine.update_weights([list(model.state_dict().items())], version="1")
        first.join(60)
        second.join(60)
        assert [v.version for v in out["first"][0].weight_versions] == ["default"]  # all before the update
        assert out["second"][0].weight_version == "1"
    finally:
        queue.stop()


def test_scoring_runs_between_decode_steps_not_after_the_batch():
    """A weight-sync probe (prompt log-probs) is served between two decode steps of a running batch."""
    from megatron_rl.rollout.embedded.generation_queue import GenerationQueue

    engine = EmbeddedEngine(tiny_qwen3(0, 1024))
    probe = list(range(1, 40))
    idle = engine.prompt_logprobs(probe)[0]
    queue = GenerationQueue(engine)
    try:
        long = threading.Thread(target=lambda: queue.submit(
            [GenerateRequest((1, 2), SamplingParams(max_new_tokens=600, ignore_eos=True))]))
        long.start()
        while not engine.live_tokens() or max(engine.live_tokens()) < 5:
            time.sleep(0.005)
        busy = engine.prompt_logprobs(probe)[0]
        assert long.is_alive() and max(engine.live_tokens()) < 600
        assert torch.equal(busy, idle)
        long.join(120)
    finally:
        queue.stop()
