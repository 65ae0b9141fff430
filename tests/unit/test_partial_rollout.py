"""Partial rollouts over the SGLang protocol, against the embedded double: requests paused in place across
weight updates (``RemoteEngine(pause_mode="in_place")``, the trainer's sync in ``rollout.partial``) report
which tokens each weight version produced (SGLang 0.5.23's ``meta_info.weight_versions``), and

* every token's version tag and behaviour log-prob equal the weights that produced it -- recomputed on CPU
  with the HF models of each version, replaying the in-place pause (the KV cache of earlier tokens stays the
  old weights', as SGLang's in-place pause keeps it);
* the trainer's batch keeps the loss mask, behaviour log-probs and versions aligned with the response tokens.
"""

import inspect
import threading
import time

import pytest
import torch

from megatron_rl.orchestration.batching import train_batch
from megatron_rl.orchestration.rollout_phase import Group
from megatron_rl.rollout.client.balancer import RemoteEngine
from megatron_rl.rollout.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
from megatron_rl.rollout.client.http_client import RetryPolicy, SGLangClient
from megatron_rl.rollout.client.protocol import GenerateRequest, SamplingParams
from megatron_rl.rollout.embedded.server import EmbeddedServer
from megatron_rl.rollout.client.weight_versions import WeightVersionEvent, compute_spans, spans_to_meta
from megatron_rl.training.batch import make_micro_batches

from rollout_models import tiny_qwen3

FAST = RetryPolicy(max_attempts=2, backoff_s=0.05)
MAXPOS = 4096


def _model(seed):
    return tiny_qwen3(seed, MAXPOS)


@pytest.fixture
def server():
    server = EmbeddedServer(EmbeddedEngine(_model(0), EmbeddedEngineConfig(seeds="deterministic"))).start()
    yield server
    server.stop()


def _wait_for_tokens(engine, at_least, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = engine.live_tokens()
        if live and max(live) >= at_least:
            return
        time.sleep(0.01)
    raise AssertionError(f"the engine did not reach {at_least} tokens (live: {engine.live_tokens()})")


def _mixed_recompute(models, versions, prompt, response):
    """``[R]`` log-probs of ``response``, token ``j``'s logits computed by ``models[versions[j]]`` on one shared
    KV cache -- the in-place pause: the input that produces token ``j``'s logits goes through the weights of
    token ``j``'s version, every earlier position keeps the KV its own weights computed."""
    first = models[versions[0]]
    kw = "cache" if "cache" in inspect.signature(first.forward).parameters else "past_key_values"
    out, cache = [], None
    with torch.no_grad():
        for j, token in enumerate(response):
            ids = torch.tensor([list(prompt)]) if j == 0 else torch.tensor([[response[j - 1]]])
            res = models[versions[j]](input_ids=ids, use_cache=True, **{kw: cache})
            cache = getattr(res, "cache", None) or getattr(res, "past_key_values", None)
            out.append(float(torch.log_softmax(res.logits[0, -1].float(), -1)[token]))
    return torch.tensor(out)


def test_version_spans_follow_sglang():
    """The port of SGLang 0.5.23's span arithmetic (srt/utils/weight_versions.py)."""
    events = [WeightVersionEvent("default", 5), WeightVersionEvent("1", 5), WeightVersionEvent("2", 9)]
    spans = compute_spans(events, "3", 12)  # "1" produced no token: no span
    assert [(s.version, s.start, s.end) for s in spans] == [("default", 0, 5), ("2", 5, 9), ("3", 9, 12)]
    assert [(s.version, s.start, s.end) for s in compute_spans([], "0", 0)] == [("0", 0, 0)]
    meta = spans_to_meta(compute_spans([WeightVersionEvent("0", 4)], "1", 4), 4)  # changed after the last token
    assert meta == {"weight_versions": [{"version": "0", "start": 0, "end": 4}], "weight_version": "0"}


def test_tokens_carry_the_version_and_logprob_of_the_weights_that_produced_them(server):
    client = SGLangClient(server.url, retry=FAST)
    trainer_side = RemoteEngine([SGLangClient(server.url, retry=FAST)], weight_transport="tensor",
                                pause_mode="in_place")
    models = {0: _model(0), 1: _model(1), 2: _model(2)}
    requests = [GenerateRequest((5, 6, 7), SamplingParams(max_new_tokens=160, ignore_eos=True, seed=11)),
                GenerateRequest((9, 8), SamplingParams(max_new_tokens=3, ignore_eos=True, seed=12, n=2))]
    out = {}
    thread = threading.Thread(target=lambda: out.update(samples=RemoteEngine([client]).generate(requests)))
    thread.start()
    # two publishes while the long request runs (each would fail on SGLang's refused /flush_cache if the partial
    # sync did not skip it while requests are held)
    for version, tokens in ((1, 20), (2, 60)):
        _wait_for_tokens(server.engine, tokens)
        trainer_side.update_weights([list(models[version].state_dict().items())], version=version)
    thread.join(120)
    long, short_a, short_b = out["samples"]
    versions = long.token_versions()
    assert [s.version for s in long.weight_versions] == ["default", "1", "2"]  # "default": version 0
    assert versions[0] == 0 and versions[-1] == 2 and sorted(versions) == versions and len(versions) == 160
    assert long.weight_version == "2"
    engine = torch.tensor(long.logprobs)
    recomputed = _mixed_recompute(models, versions, long.prompt_ids, long.response_ids)
    assert torch.allclose(engine, recomputed, atol=1e-4), (engine - recomputed).abs().max()
    # the tags matter: the same tokens scored as if every token came from the final weights disagree
    final = _mixed_recompute(models, [2] * len(versions), long.prompt_ids, long.response_ids)
    assert (engine - final).abs().max() > 0.1
    # the short requests finished within one version (before any update when they share the long one's batch)
    for s in (short_a, short_b):
        v = s.token_versions()
        assert len(v) == 3 and len(set(v)) == 1 and s.weight_version == ("default" if v[0] == 0 else str(v[0]))
        assert torch.allclose(torch.tensor(s.logprobs), _mixed_recompute(models, v, s.prompt_ids, s.response_ids),
                              atol=1e-4)
    # the trainer's batch: loss mask, behaviour log-probs and versions aligned with each response token
    groups = [Group(None, [long], ["x"], [1.0], [False]), Group(None, [short_a, short_b], ["y", "z"], [0.0, 1.0],
                                                                 [False, False])]
    tb = train_batch(groups)
    samples = [long, short_a, short_b]
    for i, s in enumerate(samples):
        R = len(s.response_ids)
        assert tb.response_mask[i, :R].all() and not tb.response_mask[i, R:].any()
        assert torch.equal(tb.policy_version[i, :R], torch.tensor(s.token_versions()))
        assert (tb.policy_version[i, R:] == -1).all()
        assert torch.equal(tb.rollout_logprobs[i, :R], torch.tensor(s.logprobs, dtype=torch.float32))
    for mb in make_micro_batches(tb.replace(advantages=torch.zeros(tb.response_mask.shape)), 1):
        s = samples[int(mb.rows[0])]
        targets = mb.targets.gather(1, mb.logit_index)[0][mb.response_mask[0]]  # what each loss column predicts
        assert targets.tolist() == s.response_ids
        assert mb.policy_version[0][mb.response_mask[0]].tolist() == s.token_versions()


def test_the_in_process_engine_pauses_in_place_the_same_way():
    """EmbeddedEngine without the server: pause, update (a new version), continue -- the same spans and log-probs."""
    engine = EmbeddedEngine(_model(0), EmbeddedEngineConfig())
    models = {0: _model(0), 1: _model(1)}
    out = {}
    thread = threading.Thread(target=lambda: out.update(s=engine.generate(
        [GenerateRequest((4, 5), SamplingParams(max_new_tokens=80, ignore_eos=True, seed=3))])))
    thread.start()
    _wait_for_tokens(engine, 25)
    engine.pause()
    engine.update_weights([list(models[1].state_dict().items())], version=1)
    engine.continue_generation()
    thread.join(120)
    (s,) = out["s"]
    versions = s.token_versions()
    assert versions[0] == 0 and versions[-1] == 1 and sorted(versions) == versions and versions.count(0) >= 25
    recomputed = _mixed_recompute(models, versions, s.prompt_ids, s.response_ids)
    assert torch.allclose(torch.tensor(s.logprobs), recomputed, atol=1e-4)
