"""Issue 28, the rollout server's side, over real HTTP against the embedded server: one bad request does not fail
the others, bodies are read safely (nesting, chunked, smuggling), answers are strict JSON, /start_profile writes only
in its folder, non-finite weight buckets and huge version strings are refused, a weight group to a dead port fails
within a bound, and a non-finite engine fails the weight-sync probe loudly."""

import base64
import json
import math
import os
import socket
import threading
import time

import pytest
import torch
from safetensors.torch import save

from megatron_rl.rollout.client import wire
from megatron_rl.rollout.client.http_client import RetryPolicy, SGLangClient
from megatron_rl.rollout.client.protocol import GenerateRequest, SamplingParams
from megatron_rl.rollout.embedded import http_body
from megatron_rl.rollout.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
from megatron_rl.rollout.embedded.server import EmbeddedServer
from megatron_rl.weights.probe import WeightMismatchError, compare_logprobs

from rollout_models import tiny_qwen3

ONE_TRY = RetryPolicy(max_attempts=1)


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", str(tmp_path / "profiles"))  # the default --profile-dir
    s = EmbeddedServer(EmbeddedEngine(tiny_qwen3(), EmbeddedEngineConfig(seeds="deterministic"))).start()
    yield s
    s.stop()


def _raw(server, data: bytes, timeout: float = 30.0) -> bytes:
    """``data`` sent as it is on one connection; every byte the server answers until it closes."""
    host, port = server.httpd.server_address[:2]
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk


def _post(server, path: str, body, timeout: float = 60.0):
    """(status, parsed strict JSON or text) of one POST; a bare NaN/Infinity in the answer fails the parse."""
    data = json.dumps(body).encode()
    answer = _raw(server, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                          f"{len(data)}\r\nConnection: close\r\n\r\n".encode() + data, timeout)
    head, _, payload = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"application/json" in head and payload:
        return status, json.loads(payload, parse_constant=_no_constant)
    return status, payload.decode()


def _no_constant(name):
    raise AssertionError(f"the answer holds a bare {name}: not JSON")


def _good(seed: int):
    return {"input_ids": [1, 2, 3, seed], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 40, "temperature": 0.8, "sampling_seed": seed, "ignore_eos": True}}


def test_one_bad_request_fails_no_other(server):
    """6 well-formed requests decoding together, 3 bad ones sent while they run: the 6 answer 200 with the tokens
    they get alone; each bad one gets SGLang's verdict (a top_k past int64 is valid for SGLang and clipped to its
    "whole vocabulary"; stop_token_ids 3 and temperature NaN are refused with 400 naming the field)."""
    reference = [_post(server, "/generate", _good(s))[1]["output_ids"] for s in range(6)]
    bad = {"top_k": {"top_k": 10 ** 20}, "stop_token_ids": {"stop_token_ids": 3},
           "temperature": {"temperature": math.nan}}
    answers, bad_answers = {}, {}

    def good(s):
        answers[s] = _post(server, "/generate", _good(s))

    def poison(name):
        sp = {"max_new_tokens": 8, "ignore_eos": True, **bad[name]}
        bad_answers[name] = _post(server, "/generate", {"input_ids": [4, 5], "sampling_params": sp})

    threads = [threading.Thread(target=good, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    while server.engine.busy_since is None and any(t.is_alive() for t in threads):
        time.sleep(0.001)  # until the 6 decode: the bad ones then arrive at a running batch
    threads += [threading.Thread(target=poison, args=(name,)) for name in bad]
    for t in threads[6:]:
        t.start()
    for t in threads:
        t.join(120)
    assert [answers[s][0] for s in range(6)] == [200] * 6, answers
    assert [answers[s][1]["output_ids"] for s in range(6)] == reference
    assert bad_answers["top_k"][0] == 200 and len(bad_answers["top_k"][1]["output_ids"]) == 8
    for name in ("stop_token_ids", "temperature"):
        status, payload = bad_answers[name]
        assert status == 400 and f"sampling_params.{name}" in wire.error_message(payload), bad_answers[name]


def test_a_temperature_below_sglangs_epsilon_is_greedy_and_answers_strict_json(server):
    """SGLang: 0 <= temperature < 1e-6 is greedy. 1e-45 scaled the logits to inf and answered bare NaN log-probs."""
    def ask(t):
        status, item = _post(server, "/generate", {"input_ids": [7, 8, 9], "return_logprob": True,
                                                   "top_logprobs_num": 3, "sampling_params": {
                                                       "max_new_tokens": 6, "temperature": t, "ignore_eos": True}})
        assert status == 200, item
        return item
    tiny, greedy = ask(1e-45), ask(0.0)
    assert tiny["output_ids"] == greedy["output_ids"]
    values = [lp for lp, _, _ in tiny["meta_info"]["output_token_logprobs"]]
    assert all(isinstance(v, float) and math.isfinite(v) for v in values)
    assert values == [lp for lp, _, _ in greedy["meta_info"]["output_token_logprobs"]]
    # a non-finite number in any answer is written null (orjson's rule in SGLang), never a bare NaN
    assert json.loads(http_body.dumps({"a": [math.nan, -math.inf, 1.5]})) == {"a": [None, None, 1.5]}


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000,
                                  '{"input_ids": [5], "rid": ' + "[" * 5000 + "]" * 5000 + "}",
                                  '{"input_ids": [5], "sampling_params": ' + '{"a": ' * 70 + "1" + "}" * 71])
def test_deeply_nested_json_is_refused_with_400(server, text):
    data = text.encode()
    answer = _raw(server, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"nested deeper than 64" in payload, answer[:300]
    assert _post(server, "/generate", _good(1))[0] == 200


def test_a_chunked_body_is_read_as_the_body_never_as_a_second_request(server):
    """The smuggled /pause_generation inside a chunked body paused the server (it read no chunked body and served
    the bytes as the next request). Both headers: refused, connection closed. Chunked alone: parsed as the body."""
    smuggled = b"POST /pause_generation HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(smuggled), smuggled)
    both = _raw(server, b"POST /flush_cache HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked"
                        b"\r\n\r\n" + chunked)
    assert both.startswith(b"HTTP/1.1 400") and both.count(b"HTTP/1.1") == 1, both
    alone = _raw(server, b"POST /flush_cache HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked)
    assert alone.startswith(b"HTTP/1.1 422") and b"json_invalid" in alone and alone.count(b"HTTP/1.1") == 1, alone
    assert not server.engine.paused and _post(server, "/generate", _good(2))[0] == 200
    body = json.dumps(_good(3)).encode()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7))
    ok = _raw(server, b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                      + chunks + b"0\r\n\r\n")
    assert ok.startswith(b"HTTP/1.1 200")
    assert json.loads(ok.partition(b"\r\n\r\n")[2])["output_ids"] == _post(server, "/generate", _good(3))[1]["output_ids"]
    for bad in (b"Transfer-Encoding: gzip\r\n\r\n{}", b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"):
        assert _raw(server, b"POST /flush_cache HTTP/1.1\r\nHost: x\r\n" + bad).startswith(b"HTTP/1.1 400")


def test_start_profile_writes_only_in_the_servers_folder(server, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "a-file").write_text("x")
    for output_dir, needle in ((str(tmp_path / "profiles" / ".." / "escaped"), "outside this server's profile folder"),
                               ("../escaped", "outside this server's profile folder"),
                               (str(outside / "a-file"), "outside this server's profile folder"),
                               (5, "expected a folder path")):
        status, payload = _post(server, "/start_profile", {"output_dir": output_dir})
        assert status == 400 and needle in wire.error_message(payload), (output_dir, payload)
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "a-file").write_text("x")
    status, payload = _post(server, "/start_profile", {"output_dir": "a-file"})
    assert status == 400 and "is an existing file" in wire.error_message(payload)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside", "profiles"]
    assert _post(server, "/start_profile", {"output_dir": "step_1"})[0] == 200  # inside: as before
    assert _post(server, "/stop_profile", {})[0] == 200
    assert os.listdir(tmp_path / "profiles" / "step_1") == ["embedded-TP-0.trace.json"]


def _bucket_b64(name: str, t: torch.Tensor) -> str:
    return base64.b64encode(save({name: t.contiguous()})).decode()


def test_a_non_finite_bucket_is_refused_and_the_old_weights_keep_serving(server):
    name, param = next(iter(server.engine.model.named_parameters()))
    before = param.detach().clone()
    prompt = {"input_ids": [1, 2, 3, 4], "return_logprob": True, "logprob_start_len": 0,
              "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
    served = _post(server, "/generate", prompt)[1]
    for bad_value in (math.nan, math.inf):
        poisoned = before.clone()
        poisoned.view(-1)[5] = bad_value
        assert _post(server, "/begin_weight_update", {})[0] == 200
        status, payload = _post(server, "/update_weights_from_tensor", {
            "serialized_named_tensors": [_bucket_b64(name, poisoned)], "load_format": "safetensors",
            "weight_version": "bad", "abort_all_requests": True})
        assert _post(server, "/end_weight_update", {})[0] == 200
        assert status == 400 and payload["success"] is False and name in payload["message"]
        assert "1 non-finite values" in payload["message"]
        assert torch.equal(param.detach(), before) and server.engine.weight_version == "default"
        assert _post(server, "/generate", prompt)[1]["meta_info"]["input_token_logprobs"] == \
            served["meta_info"]["input_token_logprobs"]
        assert server.engine.health().healthy


def test_a_finite_but_overflowing_engine_fails_the_weight_sync_probe_loudly(server):
    """Finite weights can still give non-finite log-probs (an overflow): the answer carries null (strict JSON),
    the client reads NaN, and the probe's comparison names the engine's non-finite log-probs."""
    name = "model.norm.weight"  # the final norm's scale: every logit overflows
    huge = torch.full_like(dict(server.engine.model.named_parameters())[name], 3e38)
    assert _post(server, "/begin_weight_update", {})[0] == 200
    assert _post(server, "/update_weights_from_tensor", {"serialized_named_tensors": [_bucket_b64(name, huge)],
                                                         "load_format": "safetensors"})[0] == 200
    assert _post(server, "/end_weight_update", {})[0] == 200
    ids = [1, 2, 3, 4, 5]
    engine_lp = SGLangClient(server.url, retry=ONE_TRY).prompt_logprobs(ids)
    assert engine_lp.shape == (4,) and not bool(torch.isfinite(engine_lp).any())
    with pytest.raises(WeightMismatchError, match="the engine's probe log-probs are non-finite"):
        compare_logprobs(torch.full((4,), -1.0), engine_lp, 1e-3, torch.tensor(ids))


def test_weight_versions_are_bounded(server):
    status, payload = _post(server, "/update_weight_version", {"new_version": "v" * (1 << 20)})
    assert status == 400 and "at most 256" in wire.error_message(payload)
    assert server.engine.weight_version == "default"
    assert _post(server, "/begin_weight_update", {})[0] == 200
    status, payload = _post(server, "/update_weights_from_tensor", {"serialized_named_tensors": [],
                                                                    "load_format": "safetensors",
                                                                    "weight_version": "w" * 257})
    assert status == 400 and "weight_version is 257 characters long" in payload["message"]
    assert _post(server, "/update_weight_version", {"new_version": "v" * 256})[0] == 200


def test_joining_a_weight_group_nobody_hosts_fails_within_a_bound(server):
    """It blocked for the 300 s rendezvous timeout with /health 200; now an error naming address and port once the
    connect deadline passes (the HTTP timeout below is the test's own deadline, not a timing assert)."""
    server.weight_group_connect_timeout_s = 1.0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: nobody accepts there
        status, payload = _post(server, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "g", "backend": "gloo"}, timeout=60)
    assert status == 400 and payload["success"] is False
    assert f"nothing listens on master_address:master_port = 127.0.0.1:{port}" in payload["message"]
    for body, needle in (({"world_size": 10 ** 20}, "world_size=100000000000000000000"),
                         ({"rank_offset": 0}, "rank_offset=0"), ({"master_port": 70000}, "master_port=70000")):
        status, payload = _post(server, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, **body})
        assert status == 400 and needle in payload["message"], payload


def test_an_in_process_top_k_past_int64_is_the_whole_vocabulary():
    """Requests that never pass the HTTP validation (in-process callers) cannot overflow the batch's top_k tensor."""
    engine = EmbeddedEngine(tiny_qwen3())
    huge, whole = (GenerateRequest((1, 2, 3), SamplingParams(max_new_tokens=6, seed=4, top_k=k, ignore_eos=True))
                   for k in (10 ** 20, 1 << 30))
    a, b = engine.generate([huge, whole])
    assert a.response_ids == b.response_ids and a.logprobs == b.logprobs
