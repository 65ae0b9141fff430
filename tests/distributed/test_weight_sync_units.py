"""Weight-sync pieces that need no process group: bucketing, config, the log-prob comparison, and engine
scoring (``prompt_logprobs``) in process and over HTTP (``logprob_start_len`` on the embedded server)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.weights.sync import (
    WeightMismatchError, WeightSyncConfig, compare_logprobs, iter_buckets, probe_tokens,
)
from multiproc import tiny_hf_checkpoint


def _tensors(sizes):
    return [(f"t{i}", torch.zeros(n)) for i, n in enumerate(sizes)]  # fp32: 4 bytes per element


def test_buckets_respect_the_limit_and_keep_order():
    sizes = [10, 10, 30, 5, 100, 1, 1, 25]  # elements; limit 40 elements = 160 bytes
    buckets = list(iter_buckets(_tensors(sizes), max_bytes=160))
    assert [n for b in buckets for n, _ in b] == [f"t{i}" for i in range(len(sizes))]
    assert [[t.numel() for _, t in b] for b in buckets] == [[10, 10], [30, 5], [100], [1, 1, 25]]
    for b in buckets:  # over the limit only as a lone tensor
        assert sum(t.numel() * 4 for _, t in b) <= 160 or len(b) == 1


def test_buckets_are_lazy_and_cast():
    produced = []

    def source():
        for name, t in _tensors([8] * 10):
            produced.append(name)
            yield name, t

    seen = 0
    for bucket in iter_buckets(source(), max_bytes=8 * 3 * 2, dtype=torch.bfloat16):  # 3 bf16 tensors per bucket
        seen += len(bucket)
        assert len(produced) <= seen + 1  # at most one tensor read ahead: the model is never held twice
        assert all(t.dtype == torch.bfloat16 for _, t in bucket)
    assert seen == 10
    same = torch.ones(4)
    (only,), = iter_buckets([("x", same)], max_bytes=1 << 20, dtype=torch.float32)
    assert only[1] is same  # no copy when the dtype already matches


def test_config_validation():
    assert WeightSyncConfig(bucket_mb=1.5).bucket_bytes == int(1.5 * (1 << 20))
    for bad in (dict(bucket_mb=0), dict(bucket_mb=math.inf), dict(check_tolerance=0), dict(check_tolerance=math.nan),
                dict(probe_length=1), dict(engine_dtype="float13")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            WeightSyncConfig(**bad)


def test_compare_names_the_worst_position_and_token():
    ids = probe_tokens(100, 9, seed=3)
    assert torch.equal(ids, probe_tokens(100, 9, seed=3)) and not torch.equal(ids, probe_tokens(100, 9, seed=4))
    trainer = torch.linspace(-5, -1, 8)
    ok = compare_logprobs(trainer, trainer + 1e-6, 1e-4, ids)
    assert ok.max_abs_diff <= 2e-6 and ok.length == 9
    engine = trainer.clone()
    engine[5] += 0.3
    with pytest.raises(WeightMismatchError, match=rf"by up to 0.3 at probe position 5 \(predicting token id "
                                                  rf"{int(ids[6])}") as info:
        compare_logprobs(trainer, engine, 1e-4, ids, where="test engine")
    assert info.value.position == 5 and abs(info.value.max_abs_diff - 0.3) < 1e-6
    # a low-precision engine: one noisy position passes the loose max, the mean decides
    assert compare_logprobs(trainer, engine, 1.0, ids, mean_tolerance=0.1).max_abs_diff == pytest.approx(0.3, abs=1e-6)
    with pytest.raises(WeightMismatchError, match=r"mean \|diff\| 0.3 over 8 positions \(tolerance 1, mean 0.1\)"):
        compare_logprobs(trainer, trainer + 0.3, 1.0, ids, mean_tolerance=0.1)
    engine[2] = math.nan  # not finite: a failure even though nan > tol is False; the message names the side
    with pytest.raises(WeightMismatchError, match=r"the engine's probe log-probs are non-finite \(1 of 8, first at "
                                                  r"position 2\) while the trainer's are finite") as info:
        compare_logprobs(trainer, engine, 1e-4, ids)
    assert info.value.position == 2 and info.value.max_abs_diff == math.inf
    bad_trainer = trainer.clone()
    bad_trainer[4:] = math.inf
    with pytest.raises(WeightMismatchError, match=r"the trainer's probe log-probs are non-finite \(4 of 8, first at "
                                                  r"position 4\), and so are the engine's \(1 of 8, first at position 2\)"
                                                  r": the trainer's weights diverged"):
        compare_logprobs(bad_trainer, engine, 1e-4, ids)
    with pytest.raises(WeightMismatchError, match="did not score the whole probe"):
        compare_logprobs(trainer, trainer[:-1], 1e-4, ids)


def test_probe_ids_avoid_the_id_sglang_clips():
    """SGLang reports prompt ids >= vocab_size - 1 as 0 in input_token_logprobs (defect 10): a probe never holds
    id V - 1, and still draws every other id."""
    assert set(probe_tokens(3, 2000, seed=0).tolist()) == {0, 1}
    assert set(probe_tokens(50, 5000, seed=1).tolist()) == set(range(49))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from megatron_rl.rollout.embedded.engine import EmbeddedEngine

    path = tiny_hf_checkpoint(str(tmp_path_factory.mktemp("ws") / "qwen3"), "qwen3")
    return EmbeddedEngine.from_pretrained(path)


def test_embedded_prompt_logprobs_are_teacher_forced(engine):
    ids = probe_tokens(engine.model.config.vocab_size, 40, seed=0).tolist()
    (got,) = engine.prompt_logprobs(ids)
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([ids])).logits[0].double()
    want = torch.log_softmax(logits, -1)[torch.arange(39), torch.tensor(ids[1:])]
    assert got.shape == (39,) and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, atol=1e-5)
    with pytest.raises(ValueError, match="vocab_size"):
        engine.prompt_logprobs([1, 10_000])


def test_scoring_an_id_the_server_clips_fails_clearly(engine):
    """SGLang answers id V - 1 as 0 in input_token_logprobs; the client names the position instead of returning
    log-probs of other tokens (the embedded server clips as SGLang does)."""
    from megatron_rl.rollout.client import wire
    from megatron_rl.rollout.client.http_client import SGLangClient
    from megatron_rl.rollout.embedded.server import EmbeddedServer

    last = engine.model.config.vocab_size - 1
    ids = [5, 17, last, 3]
    entries = wire.input_logprob_entries(ids, torch.zeros(3), 0, last + 1)
    assert [e[1] for e in entries] == [5, 17, 0, 3]
    needle = rf"position 2 has id 0, the prompt has {last} \(SGLang reports ids >= vocab_size - 1 as 0\)"
    with pytest.raises(ValueError, match=needle):
        wire.parse_input_logprobs({"meta_info": {"input_token_logprobs": entries}}, ids)
    server = EmbeddedServer(engine).start()
    try:
        with pytest.raises(ValueError, match=needle):
            SGLangClient(server.url).prompt_logprobs(ids)
    finally:
        server.stop()


def test_prompt_logprobs_over_http(engine):
    from megatron_rl.rollout.client.balancer import RemoteEngine
    from megatron_rl.rollout.client.http_client import SGLangClient
    from megatron_rl.rollout.embedded.server import EmbeddedServer

    server = EmbeddedServer(engine).start()
    try:
        client = SGLangClient(server.url)
        ids = [5, 17, 3, 99, 42, 7]
        (direct,) = engine.prompt_logprobs(ids)
        assert torch.allclose(client.prompt_logprobs(ids), direct, atol=1e-6)
        (remote,) = RemoteEngine([client]).prompt_logprobs(ids)  # one tensor per server
        assert torch.allclose(remote, direct, atol=1e-6)
        base = dict(input_ids=ids, return_logprob=True, sampling_params=dict(max_new_tokens=2, n=2))
        items = client.generate_raw(dict(base, logprob_start_len=0))  # SGLang's layout, repeated per sample
        for item in items:
            entries = item["meta_info"]["input_token_logprobs"]
            assert entries[0] == [None, 5, None] and [e[1] for e in entries] == ids
            assert torch.allclose(torch.tensor([e[0] for e in entries[1:]]), direct, atol=1e-6)
            assert len(item["meta_info"]["output_token_logprobs"]) == 2
        tail = client.generate_raw(dict(base, logprob_start_len=4, sampling_params=dict(max_new_tokens=1)))
        assert [e[1] for e in tail["meta_info"]["input_token_logprobs"]] == [42, 7]
        assert tail["meta_info"]["prompt_tokens"] == 4 + len(tail["meta_info"]["input_token_logprobs"])
        past = client.generate_raw(dict(base, logprob_start_len=6, sampling_params=dict(max_new_tokens=1)))
        assert past["meta_info"]["input_token_logprobs"] == []
        plain = client.generate_raw(dict(base, sampling_params=dict(max_new_tokens=1)))
        assert "input_token_logprobs" not in plain["meta_info"]  # -1 (default): no prompt log-probs
    finally:
        server.stop()
