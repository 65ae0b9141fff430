"""The embedded HTTP server over loopback with the real client: round trips, errors, weights, control."""

import base64
import http.client
import json
import threading
import time

import pytest
import torch

from megatron_rl.rollout.balancer import RemoteEngine
from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.rollout.http_client import RequestRejected, RetryPolicy, SGLangClient
from megatron_rl.rollout.protocol import GenerateRequest, SamplingParams
from megatron_rl.rollout.server import EmbeddedServer

from rollout_models import VOCAB, other_weights, tiny_qwen3, tiny_qwen3_moe

FAST = RetryPolicy(max_attempts=2, backoff_s=0.05)


@pytest.fixture
def dense_server():
    server = EmbeddedServer(EmbeddedEngine(tiny_qwen3(max_positions=4096))).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def moe_server():
    server = EmbeddedServer(EmbeddedEngine(tiny_qwen3_moe())).start()
    yield server
    server.stop()


def _reqs(routed=False):
    return [GenerateRequest((1, 2, 3), SamplingParams(max_new_tokens=8, seed=1, top_p=0.9, ignore_eos=True),
                            return_top_logprobs=2, return_routed_experts=routed),
            GenerateRequest(tuple(range(20, 31)), SamplingParams(max_new_tokens=6, seed=2, n=3, temperature=0.8),
                            return_top_logprobs=2, return_routed_experts=routed)]


def test_round_trip_equals_direct_engine_output(moe_server):
    client = SGLangClient(moe_server.url, retry=FAST)
    remote = RemoteEngine([client]).generate(_reqs(routed=True))
    direct = moe_server.engine.generate(_reqs(routed=True))
    assert len(remote) == len(direct) == 4
    for r, d in zip(remote, direct):
        assert r.response_ids == d.response_ids and r.prompt_ids == d.prompt_ids
        # JSON floats round-trip exactly, but the server may batch the two requests differently from the
        # direct call, which reorders float sums in the forward pass (~1e-6)
        assert torch.allclose(torch.tensor(r.logprobs), torch.tensor(d.logprobs), atol=1e-5)
        assert (r.finish_reason, r.matched_stop, r.sample_index) == (d.finish_reason, d.matched_stop, d.sample_index)
        assert torch.equal(r.top_logprob_ids, d.top_logprob_ids)
        assert torch.allclose(r.top_logprob_values, d.top_logprob_values, atol=1e-5)
        assert torch.equal(r.prompt_routed_experts, d.prompt_routed_experts)
        # SGLang's wire format stops one token short: the last response row comes back as -1
        assert torch.equal(r.routed_experts[:-1], d.routed_experts[:-1]) and (r.routed_experts[-1] == -1).all()
        assert r.weight_version == d.weight_version and r.logprob_mode == "raw"


def test_sglang_response_shape(moe_server):
    client = SGLangClient(moe_server.url, retry=FAST)
    one = client.generate_raw({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
                               "return_logprob": True, "return_routed_experts": True})
    meta = one["meta_info"]
    assert set(one) == {"text", "output_ids", "meta_info"}
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 4
    assert [p[1] for p in meta["output_token_logprobs"]] == one["output_ids"]
    assert len(base64.b64decode(meta["routed_experts"])) == (3 + 4 - 1) * 3 * 2 * 4  # rows * layers * topk * int32
    batch = client.generate_raw({"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 2, "n": 2}})
    assert isinstance(batch, list) and len(batch) == 4 and "output_token_logprobs" not in batch[0]["meta_info"]


@pytest.mark.parametrize("body, field", [
    ({}, "input_ids"),
    ({"text": "hello"}, "text"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, "a"]}, "input_ids"),
    ({"input_ids": [1], "sampling_params": {"top_p": 2}}, "sampling_params.top_p"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"input_ids": [1], "sampling_params": {"sampling_seed": -3}}, "sampling_params.sampling_seed"),
    ({"input_ids": [1], "sampling_params": {"frobnicate": 1}}, "sampling_params.frobnicate"),
    ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, "sampling_params.frequency_penalty"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
    ({"input_ids": [1], "top_logprobs_num": -1}, "top_logprobs_num"),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [1, 2], "logprob_start_len": -2}, "logprob_start_len"),
    ({"input_ids": [1], "stream": True}, "stream"),
    ({"input_ids": [VOCAB + 1]}, "input_ids"),
    ({"input_ids": [[1], [VOCAB + 1]]}, "input_ids[1]"),
    ({"input_ids": [1], "return_routed_experts": True}, "input_ids"),  # dense model
])
def test_malformed_generate_is_400_naming_the_field(dense_server, body, field):
    client = SGLangClient(dense_server.url, retry=FAST)
    with pytest.raises(RequestRejected) as info:
        client.generate_raw(body)
    assert info.value.status == 400 and info.value.field == field
    assert str(info.value)  # carries the server's message


def test_other_malformed_requests(dense_server):
    host, port = dense_server.httpd.server_address[:2]

    def raw(method, path, data):
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())

    status, payload = raw("POST", "/generate", b"{not json")
    assert status == 400 and payload["param"] == "body" and "JSON" in payload["message"]
    assert raw("POST", "/generate", b"[1, 2]")[0] == 400
    assert raw("POST", "/no_such_endpoint", b"{}")[0] == 404
    assert raw("GET", "/generate", None)[0] == 405
    client = SGLangClient(dense_server.url, retry=FAST)
    for path, body, field in [("/update_weights_from_tensor", {"serialized_named_tensors": ["x"]}, "load_format"),
                              ("/update_weights_from_tensor", {"load_format": "safetensors",
                                                               "serialized_named_tensors": ["%%%"]},
                               "serialized_named_tensors"),
                              ("/abort_request", {}, "rid"), ("/pause_generation", {"mode": "later"}, "mode"),
                              ("/update_weight_version", {}, "new_version"),
                              ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [],
                                                                    "group_name": "nope"}, "group_name")]:
        with pytest.raises(RequestRejected) as info:
            client.request("POST", path, body)
        assert info.value.status == 400 and info.value.field == field, (path, info.value)


@pytest.mark.parametrize("shared_files", [True, False], ids=["shm-file", "base64"])
def test_update_weights_from_tensor_over_http(dense_server, shared_files, tmp_path, monkeypatch):
    import megatron_rl.rollout.http_client as http_client

    monkeypatch.setattr(http_client, "_shared_dir", lambda: str(tmp_path))
    client = SGLangClient(dense_server.url, retry=FAST)
    assert client.shared_files  # a loopback server is on this machine
    client.shared_files = shared_files
    engine = RemoteEngine([client], weight_transport="tensor")
    req = [GenerateRequest((3, 4, 5), SamplingParams(max_new_tokens=12, seed=2, ignore_eos=True))]
    target = EmbeddedEngine(tiny_qwen3(seed=1, max_positions=4096)).generate(req)[0]
    before = engine.generate(req)[0]
    assert before.response_ids != target.response_ids
    with pytest.raises(RequestRejected, match="unknown name.*model.layers.0.bogus"):
        engine.update_weights([[("model.layers.0.bogus", torch.zeros(2))]], version=1)
    weights = other_weights(tiny_qwen3, seed=1)
    engine.update_weights((weights[i:i + 7] for i in range(0, len(weights), 7)), version=5)  # a generator
    after = engine.generate(req)[0]
    assert after.response_ids == target.response_ids and after.weight_version == "5"
    assert client.get_weight_version() == "5"
    assert client.shared_files == shared_files and list(tmp_path.iterdir()) == []  # files removed


def test_weight_files_fall_back_to_bytes_when_the_server_cannot_read_them(dense_server, monkeypatch):
    import safetensors.torch

    def unreadable(path, *a, **kw):
        raise FileNotFoundError(path)

    monkeypatch.setattr(safetensors.torch, "load_file", unreadable)  # a server on another filesystem
    client = SGLangClient(dense_server.url, retry=FAST)
    weights = other_weights(tiny_qwen3, seed=1)
    RemoteEngine([client], weight_transport="tensor").update_weights([weights], version=7)
    assert not client.shared_files and client.get_weight_version() == "7"


def test_only_servers_on_this_machine_get_weight_files():
    from megatron_rl.rollout.http_client import _is_local_address

    assert _is_local_address("127.0.0.1") and _is_local_address("localhost")
    assert not _is_local_address("198.51.100.254")  # TEST-NET-2: an address of no interface here
    assert not SGLangClient("http://198.51.100.254:30000").shared_files


def test_update_weights_from_distributed_over_gloo(dense_server):
    client = SGLangClient(dense_server.url, retry=FAST)
    engine = RemoteEngine([client], weight_transport="distributed")
    engine.init_weight_sync("127.0.0.1", 0, backend="gloo", timeout_s=60)
    weights = other_weights(tiny_qwen3, seed=1)
    engine.update_weights([weights[:5], weights[5:]], version="d1")
    for name, t in weights:
        assert torch.equal(dense_server.engine.model.state_dict()[name], t), name
    assert dense_server.engine.weight_version == "d1"


def _generate_in_thread(client, req):
    out = {}

    def run():
        try:
            out["samples"] = client.generate_one(req)
        except Exception as e:  # noqa: BLE001
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_abort_pause_continue(dense_server):
    client = SGLangClient(dense_server.url, retry=FAST)
    long_req = GenerateRequest((1, 2), SamplingParams(max_new_tokens=3000, ignore_eos=True, seed=1), rid="long-1")
    thread, out = _generate_in_thread(client, long_req)
    time.sleep(0.3)
    client.abort_request("long-1")
    thread.join(30)
    sample = out["samples"][0]
    assert sample.finish_reason == "abort" and 0 < len(sample.response_ids) < 3000 and sample.rid == "long-1"
    # in-place pause holds a request; continue lets it finish
    client.pause_generation(mode="in_place")
    assert dense_server.engine.health().paused
    thread, out = _generate_in_thread(client, GenerateRequest((1,), SamplingParams(max_new_tokens=5, ignore_eos=True)))
    time.sleep(0.3)
    assert thread.is_alive()
    client.continue_generation()
    thread.join(30)
    assert out["samples"][0].finish_reason == "length"
    # weights can be updated while a request is held by an in-place pause (partial rollouts)
    long_req = GenerateRequest((1,), SamplingParams(max_new_tokens=1000, ignore_eos=True))
    thread, out = _generate_in_thread(client, long_req)
    time.sleep(0.1)
    client.pause_generation(mode="in_place")
    RemoteEngine([client]).update_weights([other_weights(lambda seed: tiny_qwen3(seed, 4096), seed=1)], version="mid")
    assert thread.is_alive()
    client.continue_generation()
    thread.join(30)
    assert out["samples"][0].finish_reason == "length" and out["samples"][0].weight_version == "mid"
    # pause with mode=abort aborts queued requests
    client.pause_generation(mode="abort")
    thread, out = _generate_in_thread(client, GenerateRequest((1,), SamplingParams(max_new_tokens=5)))
    time.sleep(0.2)
    client.abort_request(abort_all=True)
    thread.join(30)
    client.continue_generation()
    assert out["samples"][0].finish_reason == "abort"


def test_release_resume_health_and_version(dense_server):
    client = SGLangClient(dense_server.url, retry=FAST)
    assert client.health()
    client.release_memory_occupation()
    with pytest.raises(RequestRejected, match="resume_memory") as info:
        client.generate_one(GenerateRequest((1,), SamplingParams(max_new_tokens=2)))
    assert info.value.status == 409
    client.resume_memory_occupation()
    client.update_weight_version("v9")
    client.flush_cache()
    assert client.get_weight_version() == "v9"
    assert client.generate_one(GenerateRequest((1,), SamplingParams(max_new_tokens=2)))[0].weight_version == "v9"
    assert client.server_info()["logprob_mode"] == "raw"


@pytest.mark.parametrize("policy", ["round_robin", "least_outstanding"])
def test_balancer_spreads_requests(policy):
    servers = [EmbeddedServer(EmbeddedEngine(tiny_qwen3())).start() for _ in range(2)]
    try:
        clients = [SGLangClient(s.url, retry=FAST) for s in servers]
        for c, tag in zip(clients, ("a", "b")):
            c.update_weight_version(tag)
        engine = RemoteEngine(clients, policy=policy)
        reqs = [GenerateRequest((i + 1,), SamplingParams(max_new_tokens=20, seed=i, ignore_eos=True)) for i in range(8)]
        samples = engine.generate(reqs)
        versions = [s.weight_version for s in samples]
        assert set(versions) == {"a", "b"} and min(versions.count("a"), versions.count("b")) >= 2
        assert [s.prompt_ids for s in samples] == [list(r.prompt_ids) for r in reqs]  # order kept
        assert engine.outstanding == [0, 0] and engine.health().healthy
        engine.shutdown()
    finally:
        for s in servers:
            s.stop()


def test_concurrent_requests_are_gathered_into_one_engine_call():
    """A driver's concurrent requests share one batch (one engine call), not first-arrival + the rest."""
    from megatron_rl.rollout.protocol import Sample
    from megatron_rl.rollout.server import GenerationQueue

    class Recorder:
        weight_version = "0"

        def __init__(self):
            self.calls = []

        def generate(self, requests):
            self.calls.append(len(requests))
            time.sleep(0.05)  # a running batch: arrivals after its start would have to wait for it
            return [Sample(prompt_ids=list(r.prompt_ids), response_ids=[1], logprobs=[0.0], finish_reason="length")
                    for r in requests for _ in range(r.sampling.n)]

    engine = Recorder()
    queue = GenerationQueue(engine, gather_quiet_s=0.3, gather_max_s=5.0)  # generous: loaded 2-core CI
    try:
        results = {}

        def submit(i):
            results[i] = queue.submit([GenerateRequest((i + 1,), SamplingParams(n=2))])

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
            time.sleep(0.005)
        for t in threads:
            t.join(30)
        assert engine.calls == [6]
        assert all(len(results[i]) == 2 and results[i][0].prompt_ids == [i + 1] for i in range(6))
    finally:
        queue.stop()
