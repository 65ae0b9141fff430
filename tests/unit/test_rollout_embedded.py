"""EmbeddedEngine on tiny Qwen3 models: reproducibility, exact log-probs, stopping, n>1, weight updates."""

import pytest
import torch

from megatron_rl.rollout.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig, EngineUnavailableError
from megatron_rl.rollout.embedded.hf_weights import WeightUpdateError
from megatron_rl.rollout.client.protocol import GenerateRequest, SamplingParams
from megatron_rl.rollout.embedded.sampling import processed_logprob_reference

from rollout_models import EOS, VOCAB, other_weights, recompute_logits, tiny_qwen3, tiny_qwen3_moe

# Tolerance for engine log-probs vs an unpadded full-sequence recomputation (fp32): measured ~5e-7;
# the gap is left-padding + KV-cache vs one forward reordering float sums.
ATOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3()


def _req(prompt, **kw):
    top = kw.pop("top", 0)
    return GenerateRequest(tuple(prompt), SamplingParams(**kw), return_top_logprobs=top)


def test_seeded_generation_is_independent_of_batch_composition(model):
    engine = EmbeddedEngine(model)
    target = _req([5, 6, 7], max_new_tokens=24, seed=11, top_p=0.9, ignore_eos=True)
    alone = engine.generate([target])[0]
    again = engine.generate([target])[0]
    others = [_req([9] * 13, max_new_tokens=5, seed=1, temperature=0.5),
              _req([1, 2], max_new_tokens=30, top_k=5, n=2)]
    batched = engine.generate([others[0], target, others[1]])
    in_batch = batched[1]
    assert alone.response_ids == again.response_ids == in_batch.response_ids
    assert torch.allclose(torch.tensor(alone.logprobs), torch.tensor(in_batch.logprobs), atol=ATOL)
    assert len(batched) == 4 and [s.sample_index for s in batched] == [0, 0, 0, 1]
    # a different seed gives a different sequence
    other_seed = engine.generate([_req([5, 6, 7], max_new_tokens=24, seed=12, top_p=0.9, ignore_eos=True)])[0]
    assert other_seed.response_ids != alone.response_ids


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_logprobs_equal_forward_recomputation(model, mode):
    engine = EmbeddedEngine(model, EmbeddedEngineConfig(logprob_mode=mode))
    params = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8), dict(temperature=1.3, top_k=8, min_p=0.02),
              dict(temperature=0.0)]
    reqs = [_req(list(range(3 + i, 10 + 2 * i)), max_new_tokens=20, seed=i, top=3, **p) for i, p in enumerate(params)]
    samples = engine.generate(reqs)
    for s, req in zip(samples, reqs):
        assert s.logprob_mode == mode and len(s.logprobs) == len(s.response_ids) > 0
        logits = recompute_logits(model, s.prompt_ids, s.response_ids)
        sp = req.sampling
        if mode == "raw":
            t = sp.temperature if sp.temperature > 0 else 1.0
            ref = torch.log_softmax(logits / t, -1).gather(1, torch.tensor(s.response_ids)[:, None]).squeeze(1)
        else:
            ref = torch.tensor([processed_logprob_reference(lg, tok, sp) for lg, tok in zip(logits, s.response_ids)])
        assert torch.allclose(torch.tensor(s.logprobs), ref.float(), atol=ATOL), (mode, sp)
        assert s.top_logprob_ids.shape == (len(s.response_ids), 3)
        assert torch.equal(s.top_logprob_ids[:, 0], logits.argmax(-1))
        if sp.temperature == 0:
            assert s.response_ids == logits.argmax(-1).tolist()


def test_stop_tokens_max_tokens_and_finish_reasons(model):
    engine = EmbeddedEngine(model)
    stop = tuple(range(0, VOCAB, 2))  # half the vocabulary: a stop comes within a few tokens
    s = engine.generate([_req([1, 2, 3], max_new_tokens=60, seed=3, stop_token_ids=stop, ignore_eos=True)])[0]
    assert s.finish_reason == "stop" and s.matched_stop == s.response_ids[-1] in stop
    assert not any(t in stop for t in s.response_ids[:-1])
    s = engine.generate([_req([1, 2, 3], max_new_tokens=17, seed=3, ignore_eos=True)])[0]
    assert s.finish_reason == "length" and len(s.response_ids) == 17 and s.matched_stop is None
    # EOS stops unless ignore_eos; here every odd token id is an EOS for the engine
    eos_engine = EmbeddedEngine(model, EmbeddedEngineConfig(eos_token_ids=tuple(range(1, VOCAB, 2))))
    s = eos_engine.generate([_req([1, 2, 3], max_new_tokens=60, seed=4)])[0]
    assert s.finish_reason == "stop" and s.response_ids[-1] % 2 == 1
    assert EmbeddedEngine(model).eos_ids == (EOS,)
    # the context length caps the response too
    short = EmbeddedEngine(model, EmbeddedEngineConfig(max_context=10))
    s = short.generate([_req([1, 2, 3, 4], max_new_tokens=50, seed=5, ignore_eos=True)])[0]
    assert s.finish_reason == "length" and len(s.response_ids) == 6
    with pytest.raises(ValueError, match="context length"):
        short.generate([_req(list(range(10)), max_new_tokens=5)])
    with pytest.raises(ValueError, match="vocab_size"):
        engine.generate([_req([VOCAB + 5], max_new_tokens=5)])


def test_n_samples_per_prompt(model):
    engine = EmbeddedEngine(model)
    samples = engine.generate([_req([4, 5, 6], max_new_tokens=12, n=4, seed=21, ignore_eos=True),
                               _req([7], max_new_tokens=3, n=2, ignore_eos=True)])
    assert [s.sample_index for s in samples] == [0, 1, 2, 3, 0, 1]
    first = samples[:4]
    assert len({tuple(s.response_ids) for s in first}) == 4  # distinct streams
    assert all(s.prompt_ids == [4, 5, 6] for s in first) and samples[4].prompt_ids == [7]
    assert len({s.rid for s in first}) == 1 and samples[4].rid != first[0].rid
    # same request again: same n samples (each from seed (21, j))
    again = engine.generate([_req([4, 5, 6], max_new_tokens=12, n=4, seed=21, ignore_eos=True)])
    assert [s.response_ids for s in again] == [s.response_ids for s in first]


def test_samples_of_one_prompt_share_one_prefill(model, monkeypatch):
    """The n samples of a request (and equal prompts of different requests) run the prompt forward once;
    tokens and log-probs are those of a prefill per row."""
    reqs = [_req([4, 5, 6, 7], max_new_tokens=10, n=3, seed=1, ignore_eos=True),
            _req([9, 8], max_new_tokens=10, n=2, seed=2, top_k=5, ignore_eos=True),
            _req([4, 5, 6, 7], max_new_tokens=10, seed=3, ignore_eos=True)]
    engine = EmbeddedEngine(model)
    batches = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: batches.append(kw["input_ids"].shape), with_kwargs=True)
    try:
        shared = engine.generate(reqs)
    finally:
        hook.remove()
    assert batches[0] == (2, 4) and all(b == (6, 1) for b in batches[1:])  # 2 distinct prompts, then 6 rows
    unshared_prefill = EmbeddedEngine._prefill
    monkeypatch.setattr(EmbeddedEngine, "_prefill",
                        lambda self, rows, ids, mask, pos, share: unshared_prefill(self, rows, ids, mask, pos, False))
    plain = EmbeddedEngine(model).generate(reqs)
    assert [s.response_ids for s in shared] == [s.response_ids for s in plain]
    for a, b in zip(shared, plain):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=ATOL)


def test_unseeded_requests_follow_the_engine_seed(model):
    a = EmbeddedEngine(model, EmbeddedEngineConfig(seed=5)).generate([_req([1, 2], max_new_tokens=10, ignore_eos=True)])
    b = EmbeddedEngine(model, EmbeddedEngineConfig(seed=5)).generate([_req([1, 2], max_new_tokens=10, ignore_eos=True)])
    assert a[0].response_ids == b[0].response_ids


def test_update_weights_changes_outputs_and_validates():
    engine = EmbeddedEngine(tiny_qwen3(seed=0))
    reference = EmbeddedEngine(tiny_qwen3(seed=1))
    req = _req([3, 4, 5], max_new_tokens=15, seed=2, ignore_eos=True)
    before = engine.generate([req])[0]
    target = reference.generate([req])[0]
    assert before.response_ids != target.response_ids
    with pytest.raises(WeightUpdateError) as info:
        engine.update_weights([[("model.layers.0.mlp.up_proj.weight", torch.zeros(64, 32)),
                                ("model.layers.0.self_attn.qq_proj.weight", torch.zeros(32, 32)),
                                ("not.a.weight", torch.zeros(1))]], version=7)
    msg = str(info.value)
    assert "2 unknown name(s)" in msg and "qq_proj" in msg and "not.a.weight" in msg and "closest" in msg
    with pytest.raises(WeightUpdateError, match="shape mismatch.*got \\(3, 3\\)"):
        engine.update_weights([[("model.norm.weight", torch.zeros(3, 3))]], version=7)
    assert engine.generate([req])[0].response_ids == before.response_ids  # rejected buckets changed nothing
    assert engine.weight_version == "default" and engine.health().healthy
    weights = other_weights(tiny_qwen3, seed=1)
    engine.update_weights([weights[:10], weights[10:]], version=3)  # two buckets
    after = engine.generate([req])[0]
    assert after.response_ids == target.response_ids and after.weight_version == "3"
    # a rejected bucket after an applied one leaves the engine flagged, version unchanged
    with pytest.raises(WeightUpdateError):
        engine.update_weights([weights[:2], [("nope", torch.zeros(1))]], version=4)
    assert engine.weight_version == "3" and not engine.health().healthy


def test_update_weights_accepts_per_expert_hf_names():
    engine = EmbeddedEngine(tiny_qwen3_moe(seed=0))
    other = tiny_qwen3_moe(seed=1)
    buckets = []
    for name, t in other.state_dict().items():
        if name.endswith("experts.gate_up_proj"):  # split into HF checkpoint per-expert names
            prefix, inter = name[: -len(".gate_up_proj")], t.shape[1] // 2
            buckets.append([(f"{prefix}.{e}.gate_proj.weight", t[e, :inter]) for e in range(t.shape[0])]
                           + [(f"{prefix}.{e}.up_proj.weight", t[e, inter:]) for e in range(t.shape[0])])
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            buckets.append([(f"{prefix}.{e}.down_proj.weight", t[e]) for e in range(t.shape[0])])
        else:
            buckets.append([(name, t)])
    engine.update_weights(buckets, version="moe-1")
    for name, t in other.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], t), name


def test_weight_update_in_place_slots_validate_and_flag_failures():
    """The per-rank weight sync writes pieces into ``weight_update``'s target: each slot is checked against the
    trainer's full shape; a failure inside leaves the engine flagged and the version unchanged."""
    engine = EmbeddedEngine(tiny_qwen3(seed=0))
    weights = dict(other_weights(tiny_qwen3, seed=1))
    with engine.weight_update(version=5) as target:
        for name, t in weights.items():
            half = t.shape[0] // 2  # two pieces per tensor, as two TP ranks would send them
            slot = target.slot(name, t.shape)
            slot[:half].copy_(t[:half])
            slot[half:].copy_(t[half:])
    assert engine.weight_version == "5" and engine.health().healthy
    assert all(torch.equal(engine.weights.resolve(n), t) for n, t in weights.items())
    with pytest.raises(WeightUpdateError, match=r"unknown name 'model.layers.0.self_attn.qq_proj.weight' \(closest"):
        with engine.weight_update(version=6) as target:
            target.slot("model.layers.0.self_attn.qq_proj.weight", (32, 32))
    assert engine.weight_version == "5" and not engine.health().healthy
    with pytest.raises(WeightUpdateError, match=r"model.norm.weight has shape \(3, 3\) on the trainer, \(32,\)"):
        engine.weights.slot("model.norm.weight", (3, 3))


def test_release_and_resume_memory(model):
    engine = EmbeddedEngine(model)
    engine.release_memory()
    assert engine.health().memory_released
    with pytest.raises(EngineUnavailableError, match="resume_memory"):
        engine.generate([_req([1], max_new_tokens=2)])
    engine.resume_memory()
    assert len(engine.generate([_req([1], max_new_tokens=2, ignore_eos=True)])[0].response_ids) == 2
