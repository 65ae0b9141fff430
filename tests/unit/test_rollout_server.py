"""The embedded HTTP server (a double of SGLang 0.5.23) over loopback with the real client: round trips,
SGLang's rules (sessions, seeds, n children, processed log-probs, routed experts, error bodies, endpoints),
request limits, health, weights, control."""

import base64
import http.client
import json
import threading
import time

import pytest
import torch

from megatron_rl.rollout.client import wire
from megatron_rl.rollout.client.balancer import RemoteEngine
from megatron_rl.rollout.client.weight_group_host import WeightTransportError
from megatron_rl.rollout.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
from megatron_rl.rollout.client.http_client import RequestRejected, RetryPolicy, ServerError, SGLangClient
from megatron_rl.rollout.client.protocol import ExpertLayout, GenerateRequest, SamplingParams
from megatron_rl.rollout.embedded.sampling import processed_logprob_reference
from megatron_rl.rollout.embedded.server import EmbeddedServer, ServerLimits

from rollout_models import VOCAB, other_weights, recompute_logits, tiny_qwen3, tiny_qwen3_moe

FAST = RetryPolicy(max_attempts=2, backoff_s=0.05)


def _server(model, seeds="deterministic", **kw):
    return EmbeddedServer(EmbeddedEngine(model, EmbeddedEngineConfig(seeds=seeds)), **kw).start()


@pytest.fixture
def dense_server():
    server = _server(tiny_qwen3(max_positions=4096))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def moe_server():
    server = _server(tiny_qwen3_moe(dense_layers=(1,)))  # decoder layers: MoE, dense, MoE
    yield server
    server.stop()


def _reqs(routed=False):
    return [GenerateRequest((1, 2, 3), SamplingParams(max_new_tokens=8, seed=1, top_p=0.9, ignore_eos=True),
                            return_top_logprobs=2, return_routed_experts=routed),
            GenerateRequest(tuple(range(20, 31)), SamplingParams(max_new_tokens=6, seed=2, n=3, temperature=0.8),
                            return_top_logprobs=2, return_routed_experts=routed)]


def _raw(server, method, path, data, headers=None):
    host, port = server.httpd.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request(method, path, body=data, headers=headers or {"Content-Type": "application/json"})
    resp = conn.getresponse()
    body = resp.read()
    try:
        return resp.status, json.loads(body) if body else None
    except ValueError:
        return resp.status, body.decode()


def test_round_trip_equals_direct_engine_output(moe_server):
    """The client's batch of n one-sample items, seeded derive_seed(seed, j), reproduces the in-process engine's n
    samples."""
    client = SGLangClient(moe_server.url, retry=FAST, expert_layout=moe_server.engine.routing.layout)
    remote = RemoteEngine([client]).generate(_reqs(routed=True))
    direct = EmbeddedEngine(moe_server.engine.model).generate(_reqs(routed=True))
    assert len(remote) == len(direct) == 4
    for r, d in zip(remote, direct):
        assert r.response_ids == d.response_ids and r.prompt_ids == d.prompt_ids
        # the server may batch the requests differently from the direct call (float sums reorder, ~1e-6)
        assert torch.allclose(torch.tensor(r.logprobs), torch.tensor(d.logprobs), atol=1e-5)
        assert (r.finish_reason, r.matched_stop, r.sample_index) == (d.finish_reason, d.matched_stop, d.sample_index)
        assert torch.equal(r.top_logprob_ids, d.top_logprob_ids)
        assert torch.allclose(r.top_logprob_values, d.top_logprob_values, atol=1e-5)
        assert torch.equal(r.prompt_routed_experts, d.prompt_routed_experts)  # the 2 MoE layers of 3
        # SGLang's wire format stops one token short: the last response row comes back as -1
        assert torch.equal(r.routed_experts[:-1], d.routed_experts[:-1]) and (r.routed_experts[-1] == -1).all()
        assert r.weight_version == d.weight_version and r.logprob_mode == "raw"


def test_routed_experts_have_one_column_block_per_decoder_layer(moe_server):
    """SGLang: int32 [prompt + completion - 1, num_hidden_layers, topk], zeros in dense layers (defect 7)."""
    client = SGLangClient(moe_server.url, retry=FAST)
    one = client.generate_raw({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
                               "return_logprob": True, "return_routed_experts": True})
    meta = one["meta_info"]
    assert set(one) == {"text", "output_ids", "meta_info"}
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 4
    assert [p[1] for p in meta["output_token_logprobs"]] == one["output_ids"]
    full = torch.frombuffer(bytearray(base64.b64decode(meta["routed_experts"])), dtype=torch.int32).view(-1, 3, 2)
    assert full.shape[0] == 3 + 4 - 1 and (full[:, 1] == 0).all() and (full[:, [0, 2]] >= 0).all()
    layout = ExpertLayout((True, False, True), 2)
    assert torch.equal(wire.decode_routed(meta["routed_experts"], layout), full[:, [0, 2]])
    # read as if it held the MoE layers only (what the client did before), the rows do not add up
    req = GenerateRequest((1, 2, 3), SamplingParams(max_new_tokens=4), return_routed_experts=True)
    with pytest.raises(ValueError, match="routed_experts has 9 rows, expected prompt\\+response-1 = 6"):
        wire.sample_from_json(one, req, 0, ExpertLayout((True, True), 2))
    with pytest.raises(ValueError, match="not a multiple of num_hidden_layers"):
        wire.decode_routed(meta["routed_experts"], ExpertLayout((True, True, False, True, True), 2))


def test_n_children_share_the_seed_and_get_fresh_rids(moe_server):
    """SGLang under deterministic inference gives the n children of one request its seed (identical tokens)
    and fresh rids; the client sends a batch of n one-sample items with their own seeds and rids (defects 4, 11)."""
    client = SGLangClient(moe_server.url, retry=FAST)
    items = client.generate_raw({"input_ids": [5, 6], "rid": "mine", "return_logprob": True,
                                 "sampling_params": {"max_new_tokens": 6, "n": 4, "sampling_seed": 9}})
    assert len({tuple(i["output_ids"]) for i in items}) == 1
    assert len({i["meta_info"]["id"] for i in items}) == 4 and "mine" not in {i["meta_info"]["id"] for i in items}
    samples = client.generate_one(GenerateRequest((5, 6), SamplingParams(max_new_tokens=6, n=4, seed=9), rid="mine"))
    assert len({tuple(s.response_ids) for s in samples}) == 4
    assert [s.rid for s in samples] == [f"mine-{j}" for j in range(4)]
    # unseeded requests: SGLang seeds them all 42; the client gives each sample a random seed
    unseeded = client.generate_one(GenerateRequest((5, 6), SamplingParams(max_new_tokens=6, n=4)))
    assert len({tuple(s.response_ids) for s in unseeded}) == 4


def test_seeds_are_ignored_without_deterministic_inference():
    """SGLang honours sampling_seed only with --enable-deterministic-inference (defect 3)."""
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 12, "sampling_seed": 3, "ignore_eos": True}}
    outputs = {}
    for seeds in ("deterministic", "ignored"):
        server = _server(tiny_qwen3(), seeds=seeds)
        try:
            client = SGLangClient(server.url, retry=FAST)
            assert client.server_info()["enable_deterministic_inference"] == (seeds == "deterministic")
            outputs[seeds] = {tuple(client.generate_raw(body)["output_ids"]) for _ in range(4)}
        finally:
            server.stop()
    assert len(outputs["deterministic"]) == 1 and len(outputs["ignored"]) > 1


def test_processed_logprobs_come_from_the_sampling_mask_fields():
    """output_token_logprobs are always raw; "processed" is output_token_sampling_logprobs (defect 5)."""
    model = tiny_qwen3()
    server = _server(model)
    try:
        params = SamplingParams(max_new_tokens=8, top_k=5, top_p=0.8, seed=4, ignore_eos=True)
        req = GenerateRequest((7, 8, 9), params)
        raw = SGLangClient(server.url, retry=FAST).generate_one(req)[0]
        processed = SGLangClient(server.url, retry=FAST, logprob_mode="processed").generate_one(req)[0]
        assert raw.response_ids == processed.response_ids and processed.logprob_mode == "processed"
        logits = recompute_logits(model, [7, 8, 9], processed.response_ids)
        for t, tok in enumerate(processed.response_ids):
            assert raw.logprobs[t] == pytest.approx(float(torch.log_softmax(logits[t].double(), -1)[tok]), abs=1e-5)
            assert processed.logprobs[t] == pytest.approx(processed_logprob_reference(logits[t], tok, params),
                                                          abs=1e-5)
        assert max(abs(a - b) for a, b in zip(raw.logprobs, processed.logprobs)) > 1e-3  # they do differ
    finally:
        server.stop()


@pytest.mark.parametrize("body, status, message", [
    ({}, 400, "input_ids"),
    ({"text": "hello"}, 400, "no tokenizer"),
    ({"input_ids": []}, 400, "cannot be empty"),
    ({"input_ids": [1, "a"]}, 400, "input_ids"),
    ({"input_ids": [1, -2]}, 400, "token id -2 is negative"),
    ({"input_ids": [1], "sampling_params": {"top_p": 2}}, 400, "top_p"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, 400, "temperature"),
    ({"input_ids": [1], "sampling_params": {"seed": 3}}, 400, "unknown field"),  # SGLang's key is sampling_seed
    ({"input_ids": [1], "sampling_params": {"frobnicate": 1}}, 400, "frobnicate"),
    ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, 400, "frequency_penalty"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, 400, "1 objects for 2 prompts"),
    ({"input_ids": [1], "top_logprobs_num": -1}, 400, "top_logprobs_num"),
    ({"input_ids": [1], "return_logprob": "yes"}, 400, "return_logprob"),
    ({"input_ids": [1], "stream": True}, 400, "stream"),
    ({"input_ids": [VOCAB + 1]}, 400, "vocab_size"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5000}}, 400, "maximum context length"),
    ({"input_ids": [1], "return_routed_experts": True}, 400, "MoE"),  # dense model
    ({"input_ids": [1], "sampling_params": {"n": 100000000, "max_new_tokens": 1}}, 400, "--max-n"),
    ({"input_ids": [[1]] * 300, "sampling_params": {"n": 20, "max_new_tokens": 1}}, 400, "--max-request-rows"),
])
def test_malformed_generate_answers_sglangs_error_body(dense_server, body, status, message):
    client = SGLangClient(dense_server.url, retry=FAST)
    with pytest.raises(RequestRejected, match=message) as info:
        client.generate_raw(body)
    assert info.value.status == status
    assert "error" in info.value.payload and "None" not in str(info.value)  # read, not "None" (defect 8)


def test_error_bodies_of_every_shape_are_read():
    assert wire.error_message({"error": {"message": "bad top_p"}}) == "bad top_p"
    assert wire.error_message({"error": "sampling_params.x: unknown field"}) == "sampling_params.x: unknown field"
    assert wire.error_message({"success": False, "message": "no session"}) == "no session"
    assert wire.error_message({"detail": [{"loc": ["body", "names"], "msg": "Field required"}]}) == \
        "body.names: Field required"
    assert wire.error_message({"detail": "Not Found"}) == "Not Found"
    assert wire.error_message("Flush cache failed.\n") == "Flush cache failed."


def test_http_layer_errors(dense_server):
    status, payload = _raw(dense_server, "POST", "/generate", b"{not json")
    assert status == 422 and "JSON" in payload["detail"][0]["msg"]
    assert _raw(dense_server, "POST", "/no_such_endpoint", b"{}") == (404, {"detail": "Not Found"})
    assert _raw(dense_server, "GET", "/generate", None)[0] == 405
    assert _raw(dense_server, "GET", "/get_weight_version", None)[0] == 404  # not in 0.5.23 (defect 9)
    status, payload = _raw(dense_server, "POST", "/generate", b"{}", {"Content-Length": "abc"})
    assert status == 400 and "Content-Length" in payload["detail"]
    status, payload = _raw(dense_server, "POST", "/generate", b"{}", {"Content-Length": "-5"})
    assert status == 400
    client = SGLangClient(dense_server.url, retry=FAST)
    for path, body, message in [("/update_weight_version", {}, "new_version: Field required"),
                                ("/pause_generation", {"mode": "later"}, "mode"),
                                ("/update_weights_from_distributed", {"names": []}, "dtypes: Field required")]:
        with pytest.raises(RequestRejected, match=message):
            client.request("POST", path, body)


def test_weight_updates_need_a_session(dense_server):
    """SGLang 0.5.23 refuses updates outside begin/end_weight_update with 400 and enters no collective (defect 1);
    RemoteEngine opens and closes the session around every sync."""
    client = SGLangClient(dense_server.url, retry=FAST)
    weights = other_weights(tiny_qwen3, seed=1)
    with pytest.raises(RequestRejected, match="between begin_weight_update"):
        client.update_weights_from_tensor([weights])
    with pytest.raises(RequestRejected, match="between begin_weight_update"):
        client.update_weights_from_distributed(weights[:1], "g")
    with pytest.raises(RequestRejected, match="no weight-update session"):
        client.end_weight_update()
    client.begin_weight_update()
    with pytest.raises(RequestRejected, match="already open"):
        client.request("POST", "/begin_weight_update", {})
    client.begin_weight_update()  # the client closes a session left open and opens a new one
    client.end_weight_update()
    RemoteEngine([client], weight_transport="tensor").update_weights([weights], version="s1")
    assert client.get_weight_version() == "s1"
    assert not dense_server._session  # closed again


@pytest.mark.parametrize("shared_files", [True, False], ids=["shm-file", "base64"])
def test_update_weights_from_tensor_over_http(dense_server, shared_files, tmp_path, monkeypatch):
    import megatron_rl.rollout.client.wire as server_mod

    monkeypatch.setattr(server_mod, "shared_dir", lambda: str(tmp_path))
    client = SGLangClient(dense_server.url, retry=FAST)
    assert client.shared_files  # a loopback server is on this machine
    client.shared_files = shared_files
    engine = RemoteEngine([client], weight_transport="tensor")
    req = [GenerateRequest((3, 4, 5), SamplingParams(max_new_tokens=12, seed=2, ignore_eos=True))]
    target = EmbeddedEngine(tiny_qwen3(seed=1, max_positions=4096)).generate(req)[0]
    before = engine.generate(req)[0]
    assert before.response_ids != target.response_ids
    with pytest.raises(ServerError, match="unknown name.*model.layers.0.bogus"):
        engine.update_weights([[("model.layers.0.bogus", torch.zeros(2))]], version=1)
    weights = other_weights(tiny_qwen3, seed=1)
    engine.update_weights((weights[i:i + 7] for i in range(0, len(weights), 7)), version=5)  # a generator
    after = engine.generate(req)[0]
    assert after.response_ids == target.response_ids and after.weight_version == "5"
    assert client.get_weight_version() == "5"
    assert client.shared_files == shared_files and list(tmp_path.iterdir()) == []  # files removed


def test_the_server_reads_weight_files_only_from_its_shared_folder(dense_server, tmp_path):
    """A client cannot make the server open an arbitrary path (defect 16.11)."""
    from safetensors.torch import save_file

    outside = tmp_path / "mrl-weights-x.safetensors"
    save_file({"model.norm.weight": torch.ones(32)}, str(outside))
    client = SGLangClient(dense_server.url, retry=FAST)
    client.begin_weight_update()
    try:
        for path in (str(outside), "/etc/passwd"):
            with pytest.raises(RequestRejected, match="not a weight file"):
                client.request("POST", "/update_weights_from_tensor", dict(serialized_named_tensors=[path],
                                                                         load_format="safetensors_file"))
    finally:
        client.end_weight_update()


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
    from megatron_rl.rollout.client.http_client import _is_local_address

    assert _is_local_address("127.0.0.1") and _is_local_address("localhost")
    assert not _is_local_address("198.51.100.254")  # TEST-NET-2: an address of no interface here
    assert not SGLangClient("http://198.51.100.254:30000").shared_files


def test_cache_is_flushed_once_per_sync(dense_server, monkeypatch):
    """Buckets go with flush_cache=false and one /flush_cache follows the last (defect 12): a per-bucket flush
    with a request queued would fail the whole update."""
    calls = []
    dispatch = dense_server.dispatch

    def record(method, path, body):
        calls.append((path, body.get("flush_cache")))
        return dispatch(method, path, body)

    monkeypatch.setattr(dense_server, "dispatch", record)
    weights = other_weights(tiny_qwen3, seed=1)
    RemoteEngine([SGLangClient(dense_server.url, retry=FAST)], weight_transport="tensor").update_weights(
        [weights[:5], weights[5:9], weights[9:]], version=2)
    paths = [p for p, _ in calls]
    assert paths.count("/flush_cache") == 1 and paths.count("/update_weights_from_tensor") == 3
    assert all(flush is False for p, flush in calls if p == "/update_weights_from_tensor")
    assert paths.index("/flush_cache") > paths.index("/end_weight_update")


def test_abort_pause_continue(dense_server):
    client = SGLangClient(dense_server.url, retry=FAST)
    out = {}

    def run(key, req):
        out[key] = client.generate_one(req)

    # abort by the rid we sent: all n samples stop (SGLang renames n > 1 children; the client sends its own)
    req = GenerateRequest((1, 2), SamplingParams(max_new_tokens=3000, ignore_eos=True, seed=1, n=2), rid="long")
    thread = threading.Thread(target=run, args=("long", req))
    thread.start()
    time.sleep(0.5)
    client.abort_request("long")
    thread.join(60)
    assert not thread.is_alive()
    assert all(s.finish_reason == "abort" and len(s.response_ids) < 3000 for s in out["long"])
    # in-place pause holds a request; continue lets it finish
    client.pause_generation(mode="in_place")
    assert not client.health()  # SGLang's health generation waits while paused
    thread = threading.Thread(target=run, args=("held", GenerateRequest((1,), SamplingParams(max_new_tokens=5,
                                                                                             ignore_eos=True))))
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive()
    client.continue_generation()
    thread.join(30)
    assert out["held"][0].finish_reason == "length"
    # pause with mode=abort aborts what runs; a request arriving while paused waits at the door (SGLang's
    # tokenizer manager holds it before registering it: abort_all does not reach it) and runs after continue
    thread = threading.Thread(target=run, args=("running", GenerateRequest((1,), SamplingParams(max_new_tokens=3000,
                                                                                                ignore_eos=True))))
    thread.start()
    time.sleep(0.3)
    client.pause_generation(mode="abort")
    thread.join(30)
    assert out["running"][0].finish_reason == "abort"
    thread = threading.Thread(target=run, args=("door", GenerateRequest((1,), SamplingParams(max_new_tokens=5,
                                                                                             ignore_eos=True))))
    thread.start()
    time.sleep(0.2)
    client.abort_request(abort_all=True)
    assert thread.is_alive()
    client.continue_generation()
    thread.join(30)
    assert out["door"][0].finish_reason == "length"


def test_weights_change_during_an_in_place_pause(dense_server):
    """Partial rollouts: weights updated while a request is held; the update flushes nothing (a running request
    makes SGLang refuse the flush), the request finishes on the new version."""
    client = SGLangClient(dense_server.url, retry=FAST)
    out = {}
    thread = threading.Thread(target=lambda: out.update(s=client.generate_one(
        GenerateRequest((1,), SamplingParams(max_new_tokens=1000, ignore_eos=True)))))
    thread.start()
    time.sleep(0.2)
    client.pause_generation(mode="in_place")
    weights = other_weights(lambda seed: tiny_qwen3(seed, 4096), seed=1)
    client.begin_weight_update()
    client.update_weights_from_tensor([weights])
    client.end_weight_update()
    with pytest.raises(RequestRejected, match="Flush cache failed"):
        client.flush_cache()
    client.update_weight_version("mid")
    assert thread.is_alive()
    client.continue_generation()
    thread.join(60)
    assert out["s"][0].finish_reason == "length" and out["s"][0].weight_version == "mid"


def test_release_resume_info_and_version(dense_server):
    client = SGLangClient(dense_server.url, retry=FAST)
    assert client.health()
    client.release_memory_occupation()  # all tags
    assert not client.health()  # SGLang cannot generate its health token without memory
    with pytest.raises(RequestRejected, match="resume_memory"):
        client.generate_one(GenerateRequest((1,), SamplingParams(max_new_tokens=2)))
    client.resume_memory_occupation(["weights"])  # resuming it twice is fatal: test_sglang_findings.py (N5)
    client.resume_memory_occupation(["kv_cache", "cuda_graph"])
    assert client.health()
    client.update_weight_version("v9")
    client.flush_cache()
    assert client.get_weight_version() == "v9" and client.model_info()["weight_version"] == "v9"
    assert client.generate_one(GenerateRequest((1,), SamplingParams(max_new_tokens=2)))[0].weight_version == "v9"
    info = client.server_info()
    assert info["tp_size"] == 1 and info["enable_deterministic_inference"] is True


def test_the_server_is_idle_once_the_last_answer_is_out(dense_server, monkeypatch):
    """SGLang's scheduler is idle once its last request finished: a release (or a flushing update) that follows
    the last answer is accepted, even while the embedded engine's decode loop is still winding down (here held
    0.5 s after it delivered every row); it waits for the loop, never a 400 'only when server is idle'."""
    engine, client = dense_server.engine, SGLangClient(dense_server.url, retry=FAST)
    stream = engine.generate_stream

    def slow_to_return(take, deliver):
        stream(take, deliver)
        time.sleep(0.5)

    monkeypatch.setattr(engine, "generate_stream", slow_to_return)
    assert client.generate_one(GenerateRequest((1, 2), SamplingParams(max_new_tokens=3)))
    client.release_memory_occupation()  # the loop is still inside generate_stream
    client.resume_memory_occupation()
    assert client.generate_one(GenerateRequest((1, 2), SamplingParams(max_new_tokens=3)))


def test_health_reflects_a_wedged_engine():
    """/health generates one token: an engine that stops making progress is reported 503 (defect 16.1)."""
    engine = EmbeddedEngine(tiny_qwen3(), EmbeddedEngineConfig(seeds="deterministic"))
    server = EmbeddedServer(engine, health_timeout_s=1.0).start()
    stall = threading.Event()
    forward = engine._forward

    def wedged(*args, **kwargs):
        stall.wait(30)
        return forward(*args, **kwargs)

    try:
        client = SGLangClient(server.url, retry=FAST)
        assert client.health(timeout_s=10)
        engine._forward = wedged
        thread = threading.Thread(target=lambda: client.generate_one(GenerateRequest((1,), SamplingParams(
            max_new_tokens=3))))
        thread.start()
        time.sleep(0.3)
        assert not client.health(timeout_s=10)
        stall.set()
        thread.join(30)
        assert client.health(timeout_s=10)
    finally:
        stall.set()
        server.stop()


def test_a_huge_request_is_refused_and_big_ones_do_not_starve_others():
    limits = ServerLimits(max_n=64, max_rows=64, max_tokens=10_000)
    server = EmbeddedServer(EmbeddedEngine(tiny_qwen3(), EmbeddedEngineConfig(max_batch_rows=8)),
                            limits=limits).start()
    try:
        client = SGLangClient(server.url, retry=FAST)
        with pytest.raises(RequestRejected, match="--max-request-tokens"):
            client.generate_raw({"input_ids": [1] * 100, "sampling_params": {"n": 64, "max_new_tokens": 100}})
        # a 64-row request runs 8 rows per batch; a small request arriving meanwhile shares one of the next
        # batches (rows are taken round-robin), so it is answered while the big one still runs
        big = threading.Thread(target=lambda: client.generate_raw(
            {"input_ids": [1], "sampling_params": {"n": 64, "max_new_tokens": 40, "ignore_eos": True}}))
        big.start()
        while server.engine.busy_since is None:  # the big request's first batch runs
            time.sleep(0.01)
        client.generate_raw({"input_ids": [2], "sampling_params": {"max_new_tokens": 1}})
        assert big.is_alive()
        big.join(300)
        assert not big.is_alive()
    finally:
        server.stop()


@pytest.mark.parametrize("policy", ["round_robin", "least_outstanding"])
def test_balancer_spreads_requests(policy):
    servers = [_server(tiny_qwen3()) for _ in range(2)]
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
    """A driver's concurrent requests start as one batch (one prefill), not first-arrival + the rest."""
    from megatron_rl.rollout.embedded.generation_queue import GenerationQueue

    engine = EmbeddedEngine(tiny_qwen3())
    takes = []
    generate_stream = engine.generate_stream

    def record(take, deliver):
        def recorded(free):
            rows = take(free)
            if rows:
                takes.append(len(rows))
            time.sleep(0.05)  # a slow step: arrivals after the start would join later
            return rows
        return generate_stream(recorded, deliver)

    engine.generate_stream = record
    queue = GenerationQueue(engine, gather_quiet_s=0.3, gather_max_s=5.0)  # generous: loaded 2-core CI
    try:
        results = {}

        def submit(i):
            results[i] = queue.submit([GenerateRequest((i + 1,), SamplingParams(n=2, max_new_tokens=2))])

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
            time.sleep(0.005)
        for t in threads:
            t.join(30)
        assert takes == [12]
        assert all(len(results[i]) == 2 and results[i][0].prompt_ids == [i + 1] for i in range(6))
    finally:
        queue.stop()


def test_the_client_keeps_a_whole_step_of_samples_in_flight(dense_server):
    """16 requests x n=8 reach the server as 128 rows at once, so it can batch them all (the
    client once kept 64 in flight: the step's last samples queued client-side behind the first ones)."""
    engine, queue = dense_server.engine, dense_server.queue
    remote = RemoteEngine([SGLangClient(dense_server.url, retry=FAST)])
    reqs = [GenerateRequest((i + 1, 2), SamplingParams(n=8, max_new_tokens=2, seed=i)) for i in range(16)]
    out = {}
    with engine._exclusive():  # the engine cannot start: the requests pile up in the server's queue
        thread = threading.Thread(target=lambda: out.setdefault("samples", remote.generate(reqs)))
        thread.start()
        waiting, deadline = 0, time.monotonic() + 30
        while waiting < 128 and time.monotonic() < deadline:
            time.sleep(0.05)
            with queue._cv:
                waiting = sum(len(job.requests) for job in queue._jobs)
    thread.join(60)
    remote.shutdown()
    assert waiting == 128
    assert len(out["samples"]) == 128


@pytest.mark.parametrize("max_in_flight, n, expected", [(20, 8, 16), (4, 8, 8)])
def test_the_client_bounds_the_samples_in_flight(dense_server, max_in_flight, n, expected):
    """``max_samples_in_flight`` counts samples, not requests: with a bound of 20 two 8-sample batches are at the
    server, never three; a request larger than the bound still goes, alone."""
    engine, queue = dense_server.engine, dense_server.queue
    remote = RemoteEngine([SGLangClient(dense_server.url, retry=FAST, max_in_flight=max_in_flight)])
    reqs = [GenerateRequest((i + 1, 2), SamplingParams(n=n, max_new_tokens=2, seed=i)) for i in range(6)]
    out, seen = {}, []
    with engine._exclusive():
        thread = threading.Thread(target=lambda: out.setdefault("samples", remote.generate(reqs)))
        thread.start()
        deadline = time.monotonic() + 30
        while (not seen or seen[-1] < expected or len(seen) < 20) and time.monotonic() < deadline:
            time.sleep(0.02)
            with queue._cv:
                seen.append(sum(len(job.requests) for job in queue._jobs))
    thread.join(60)
    remote.shutdown()
    assert max(seen) == expected
    assert len(out["samples"]) == 6 * n


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    """The embedded server in its own process: a weight group's name exists once per process, and the trainer's
    side of the group lives in this one."""
    from megatron_rl.rollout.client.process import launch_embedded_server

    path = tmp_path_factory.mktemp("tiny_qwen3")
    tiny_qwen3(max_positions=4096).save_pretrained(path)
    server = launch_embedded_server(str(path), str(path / "server.log"))
    yield server
    server.stop()


def test_update_weights_from_distributed_over_gloo(server_process):
    client = SGLangClient(server_process.url, retry=FAST)
    engine = RemoteEngine([client], weight_transport="distributed")
    engine.init_weight_sync("127.0.0.1", 0, backend="gloo", timeout_s=60)
    weights = other_weights(tiny_qwen3, seed=1)
    # a mixed-dtype bucket cannot be one flattened buffer: it goes tensor by tensor
    mixed = [(n, t.to(torch.bfloat16) if i % 2 else t) for i, (n, t) in enumerate(weights[:3])]
    engine.update_weights([mixed, weights[:5], weights[5:]], version="d1")
    assert client.get_weight_version() == "d1"
    ids = list(range(1, 40))
    expected = EmbeddedEngine(tiny_qwen3(seed=1, max_positions=4096)).prompt_logprobs(ids)[0]
    assert torch.allclose(client.prompt_logprobs(ids), expected, atol=1e-6)


@pytest.mark.timeout(180)
def test_a_refused_announce_ends_the_sync_instead_of_hanging(server_process, monkeypatch):
    """No wait on a broadcast toward a server that refused (defect 1): without a session the server refuses the
    announce at once; the sync raises with its message, and the next init_weight_sync rebuilds the group."""
    client = SGLangClient(server_process.url, retry=FAST)
    engine = RemoteEngine([client], weight_transport="distributed")
    engine.init_weight_sync("127.0.0.1", 0, backend="gloo", timeout_s=60)
    monkeypatch.setattr(client, "begin_weight_update", lambda: None)  # a session that never opened
    weights = other_weights(tiny_qwen3, seed=2)
    with pytest.raises(WeightTransportError, match="refused the weight bucket.*begin_weight_update"):
        engine.update_weights([weights], version="never")  # (a hang would hit the test's timeout)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="init_weight_sync"):
        engine.update_weights([weights], version="never")
    engine.init_weight_sync("127.0.0.1", 0, backend="gloo", timeout_s=60)  # a fresh group
    engine.update_weights([weights], version="d2")
    assert client.get_weight_version() == "d2"


def test_remote_engine_rank_offsets_follow_each_servers_tp_size(monkeypatch):
    """Engine ranks are rank_offset + tp_rank with offsets from /server_info's tp_size (defect 6)."""
    joined = []

    class Fake(SGLangClient):
        def __init__(self, url, tp):
            super().__init__(url)
            self.tp = tp

        def server_info(self):
            return {"tp_size": self.tp}

        def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                      backend="gloo"):
            joined.append((self.url, rank_offset, world_size))
            raise ServerError("stop here", self.url)

    engine = RemoteEngine([Fake("http://127.0.0.1:1", 2), Fake("http://127.0.0.1:2", 4), Fake("http://127.0.0.1:3", 1)],
                          weight_transport="distributed")
    with pytest.raises(RuntimeError, match="did not form|stop here"):
        engine.init_weight_sync("127.0.0.1", 0, timeout_s=2)
    assert sorted(joined) == [("http://127.0.0.1:1", 1, 8), ("http://127.0.0.1:2", 3, 8), ("http://127.0.0.1:3", 7, 8)]
