"""SGLang 0.5.23 findings N1-N7 of issue 24, each against the real client over loopback HTTP (the embedded
double, or a stdlib server answering as SGLang does where the double cannot take that shape)."""

import json
import logging
import threading
import time
from types import SimpleNamespace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from megatron_rl.orchestration.colocation import Colocation
from megatron_rl.orchestration.rollout_phase import Group, rollout_metrics
from megatron_rl.metrics import PhaseTimer
from megatron_rl.rollout.client.balancer import RemoteEngine
from megatron_rl.rollout.client.mask_overflow import overflowed
from megatron_rl.rollout.client.http_client import RequestRejected, RetryPolicy, ServerError, SGLangClient
from megatron_rl.rollout.client.protocol import GenerateRequest, SamplingParams
from megatron_rl.rollout.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
from megatron_rl.rollout.embedded.server import EmbeddedServer

from rollout_models import recompute_logits, tiny_qwen3
from test_colocation import _Trainers

FAST = RetryPolicy(max_attempts=3, backoff_s=0.01)


class _Scripted:
    """A loopback HTTP server answering ``answers[path] = (status, json)`` and counting the calls per path."""

    def __init__(self, answers):
        self.answers, self.calls = answers, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _answer(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.calls.append(self.path)
                status, payload = outer.answers.get(self.path, (404, {"detail": "Not Found"}))
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = "http://127.0.0.1:%d" % self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def scripted():
    servers = []

    def make(answers):
        servers.append(_Scripted(answers))
        return servers[-1]
    yield make
    for s in servers:
        s.close()


# ---- N7: 5xx retried only for idempotent calls --------------------------------------------------------------

def test_n7_a_5xx_is_not_retried_for_group_join_or_bucket_announce(scripted):
    err = (500, {"error": {"message": "boom"}})
    server = scripted({"/init_weights_update_group": err, "/update_weights_from_distributed": err,
                       "/server_info": err})
    client = SGLangClient(server.url, retry=FAST)
    with pytest.raises(ServerError, match="boom"):
        client.init_weights_update_group("127.0.0.1", 1234, 1, 2, "g")
    assert server.calls.count("/init_weights_update_group") == 1  # joined once: never twice
    with pytest.raises(ServerError, match="boom"):
        client.update_weights_from_distributed([("w", torch.zeros(2))], "g")
    assert server.calls.count("/update_weights_from_distributed") == 1
    with pytest.raises(Exception, match="failed after 3 attempt"):  # an idempotent read is still retried
        client.server_info()
    assert server.calls.count("/server_info") == 3


# ---- N6: pipeline-parallel servers cannot join the weight group --------------------------------------------

def test_n6_a_pp_server_is_refused_before_any_rank_joins(scripted):
    ok = (200, {"success": True, "message": "ok"})
    tp = scripted({"/server_info": (200, {"tp_size": 2, "pp_size": 1}), "/init_weights_update_group": ok})
    pp = scripted({"/server_info": (200, {"tp_size": 2, "pp_size": 2}), "/init_weights_update_group": ok})
    engine = RemoteEngine([SGLangClient(tp.url, retry=FAST), SGLangClient(pp.url, retry=FAST)],
                          weight_transport="distributed")
    try:
        with pytest.raises(ValueError, match=rf"{pp.url} reports pp_size=2.*--pp-size 1"):
            engine.init_weight_sync("127.0.0.1", 0, timeout_s=5)
        assert "/init_weights_update_group" not in tp.calls + pp.calls
    finally:
        engine.shutdown()


# ---- the embedded double: pause modes, flush, memory tags -----------------------------------------------------

MAXPOS = 4096


def _model(seed):
    return tiny_qwen3(seed, MAXPOS)


@pytest.fixture
def server():
    server = EmbeddedServer(EmbeddedEngine(_model(0), EmbeddedEngineConfig(seeds="deterministic"))).start()
    yield server
    server.stop()


def _record(server, monkeypatch):
    """``[(path, status)]`` of every call the server answers."""
    calls, dispatch = [], server.dispatch

    def record(method, path, body):
        try:
            status, payload = dispatch(method, path, body)
        except Exception as e:
            calls.append((path, getattr(e, "status", 500)))
            raise
        calls.append((path, status))
        return status, payload
    monkeypatch.setattr(server, "dispatch", record)
    return calls


def _wait_for_tokens(engine, at_least, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = engine.live_tokens()
        if live and max(live) >= at_least:
            return
        time.sleep(0.01)
    raise AssertionError(f"the engine did not reach {at_least} tokens (live: {engine.live_tokens()})")


def _in_background(fn):
    out = {}
    thread = threading.Thread(target=lambda: out.update(result=fn()), daemon=True)
    thread.start()
    return thread, out


def test_n1_n2_retract_reprefills_held_requests_under_the_new_weights(server, monkeypatch):
    """Partial rollouts pause with retract: the held request keeps its tokens and log-probs, every later token is
    computed from the new weights alone (its KV rebuilt, no old-weights KV under a token labelled with the new
    version: the span boundary is exact), and the per-sync flush succeeds."""
    calls = _record(server, monkeypatch)
    models = {0: _model(0), 1: _model(1)}
    trainer_side = RemoteEngine([SGLangClient(server.url, retry=FAST)], pause_mode="retract")
    req = GenerateRequest((5, 6, 7), SamplingParams(max_new_tokens=120, ignore_eos=True, seed=11))
    thread, out = _in_background(lambda: RemoteEngine([SGLangClient(server.url, retry=FAST)]).generate([req]))
    _wait_for_tokens(server.engine, 20)
    trainer_side.update_weights([list(models[1].state_dict().items())], version=1)
    thread.join(120)
    (s,) = out["result"]
    versions = s.token_versions()
    k = versions.count(0)
    assert 20 <= k < 120 and versions == [0] * k + [1] * (120 - k)
    # token j's log-prob: version j's weights over the whole prefix (teacher-forced, float32 on CPU)
    ref = {v: torch.log_softmax(recompute_logits(m, s.prompt_ids, s.response_ids).double(), -1)
           for v, m in models.items()}
    expected = torch.tensor([float(ref[v][j, t]) for j, (v, t) in enumerate(zip(versions, s.response_ids))],
                            dtype=torch.float64)
    got = torch.tensor(s.logprobs, dtype=torch.float64)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    # the old weights' log-probs differ after the boundary (the check could fail)
    assert (got[k:] - ref[0][torch.arange(k, 120), torch.tensor(s.response_ids[k:])]).abs().max() > 1e-2
    assert ("/pause_generation", 200) in calls and ("/flush_cache", 200) in calls
    assert trainer_side.flush_refused == [0]
    trainer_side.shutdown()


def test_n1_flush_needs_sglangs_idleness_and_a_refusal_is_counted(server, monkeypatch, caplog):
    """SGLang's is_fully_idle(ignore_waiting=paused): held in place -> flush refused (and a sync's refusal is
    counted and logged, never silent); retracted -> flushed."""
    client = SGLangClient(server.url, retry=FAST)
    thread, out = _in_background(lambda: client.generate_one(
        GenerateRequest((1, 2), SamplingParams(max_new_tokens=4000, ignore_eos=True))))
    _wait_for_tokens(server.engine, 5)
    client.pause_generation("in_place")
    with pytest.raises(RequestRejected, match="Flush cache failed"):
        client.flush_cache()
    client.pause_generation("retract")
    client.flush_cache()  # the held request now waits: the cache may go
    client.continue_generation()
    in_place = RemoteEngine([SGLangClient(server.url, retry=FAST)], pause_mode="in_place")
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.client.balancer"):
        in_place.update_weights([list(_model(1).state_dict().items())], version=1)
    assert in_place.flush_refused == [1]
    assert "refused /flush_cache" in caplog.text and "old weights" in caplog.text
    # the transaction stages through per-call copies of the client: the refusal is counted the same, the engine
    # stays in the transaction (a refused flush is not a failed stage)
    in_place.shutdown()
    in_place = RemoteEngine([SGLangClient(server.url, retry=FAST)], pause_mode="in_place", weight_transport="tensor")
    txn = in_place.begin_transaction(2, 60.0)
    in_place.stage_weights([list(_model(2).state_dict().items())], txn)
    assert in_place.flush_refused == [1] and txn.alive() == [0], [f.describe() for f in txn.report.failures]
    client.abort_request(abort_all=True)
    thread.join(60)
    assert out["result"][0].finish_reason == "abort"
    in_place.shutdown()


# ---- N3: sampling-mask overflow -----------------------------------------------------------------------------

def _tied_model():
    """Every logit equal: every token ties with the k-th, so any top_k > 1 support is the whole vocabulary."""
    model = _model(0)
    with torch.no_grad():
        model.get_output_embeddings().weight.zero_()
    return model


def test_n3_an_overflow_fails_the_whole_batch_and_the_client_drops_the_group(caplog):
    server = EmbeddedServer(EmbeddedEngine(_tied_model(), EmbeddedEngineConfig(sampling_mask_max_tokens=4))).start()
    try:
        client = SGLangClient(server.url, retry=FAST)
        # refused up front: a mask request needs top_k 1 or in [2, cap]
        for params in ({"top_k": 50}, {"top_p": 0.9}):
            with pytest.raises(RequestRejected, match=r"requires top_k=1 .* 1 < top_k <= 4; got top_k="):
                client.generate_raw({"input_ids": [1], "return_sampling_mask": True,
                                     "sampling_params": dict(params, max_new_tokens=2)})
        # an overflow during generation: HTTP 400 for the whole batch (both items), not an abort item
        with pytest.raises(RequestRejected, match="-> 400: Sampling support exceeds --sampling-mask-max-tokens=4"):
            client.generate_raw({"input_ids": [[1], [2]], "return_sampling_mask": True,
                                 "sampling_params": {"max_new_tokens": 3, "top_k": 2}})
        # the client sends the group again with fresh seeds, then drops it (aborted, counted, logged); the run goes on
        processed = SGLangClient(server.url, retry=FAST, logprob_mode="processed")
        engine = RemoteEngine([processed])
        req = GenerateRequest((1, 2), SamplingParams(max_new_tokens=3, top_k=2, n=3, seed=5))
        with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.client.http_client"):
            samples = engine.generate([req])
        assert len(samples) == 3 and all(overflowed(s) and s.response_ids == [] for s in samples)
        assert processed.mask_overflows == 2 and caplog.text.count("over --sampling-mask-max-tokens") == 2
        assert "the group is dropped" in caplog.text
        metrics = rollout_metrics([Group(SimpleNamespace(prompt_ids=[1, 2]), samples, [""] * 3, [0.0] * 3, [False] * 3)], [], 0, {}, {}, 1)
        assert metrics["rollout/sampling_mask_overflow"] == 3.0 and metrics["rollout/aborted"] == 3.0
        ok = engine.generate([GenerateRequest((1, 2), SamplingParams(max_new_tokens=3, top_k=1, seed=5))])
        assert ok[0].finish_reason == "length"
        engine.shutdown()
    finally:
        server.stop()


# ---- N4, N5: what kills SGLang kills the double ----------------------------------------------------------------

def _wait_down(server, client, timeout=10.0):
    deadline = time.monotonic() + timeout
    while client.health(timeout_s=1.0):
        assert time.monotonic() < deadline, "the server did not go down"
        time.sleep(0.05)
    assert server.crashed is not None


def test_n4_min_p_under_deterministic_inference_takes_the_server_down(server):
    client = SGLangClient(server.url, retry=RetryPolicy(max_attempts=1))
    with pytest.raises(ServerError, match="HTTP 500.*min_p=0.1"):
        client.generate_raw({"input_ids": [1], "sampling_params": {"min_p": 0.1, "max_new_tokens": 2}})
    _wait_down(server, client)
    assert "multinomial_with_seed" in server.crashed


def test_n5_resuming_a_tag_that_is_not_released_takes_the_server_down(server):
    client = SGLangClient(server.url, retry=RetryPolicy(max_attempts=1))
    client.release_memory_occupation(["kv_cache"])
    client.resume_memory_occupation(["kv_cache"])
    with pytest.raises(ServerError, match="HTTP 500.*KeyError: 'weights'"):
        client.resume_memory_occupation(["weights"])
    _wait_down(server, client)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_n5_release_while_requests_are_held_in_place_takes_the_server_down(server, mode):
    """SGLang asserts is_fully_idle(ignore_waiting=paused): requests held in place are running (fatal), retracted
    ones wait (the release goes through, and they finish after resume + continue)."""
    client = SGLangClient(server.url, retry=RetryPolicy(max_attempts=1))
    thread, out = _in_background(lambda: client.generate_one(
        GenerateRequest((1, 2), SamplingParams(max_new_tokens=300, ignore_eos=True))))
    _wait_for_tokens(server.engine, 5)
    client.pause_generation(mode)
    if mode == "in_place":
        with pytest.raises(ServerError, match="HTTP 500.*should be called only when server is idle"):
            client.release_memory_occupation()
        _wait_down(server, client)
        thread.join(30)
        return
    client.release_memory_occupation()
    client.resume_memory_occupation()
    client.continue_generation()
    thread.join(60)
    assert out["result"][0].finish_reason == "length" and server.crashed is None


def test_n5_the_client_never_misuses_memory_tags_in_the_runs_sequences(server, monkeypatch):
    """sync, colocated and partial sequences against the double (where a misuse is fatal, as on SGLang)."""
    calls = _record(server, monkeypatch)
    engine = RemoteEngine([SGLangClient(server.url, retry=FAST)])
    req = GenerateRequest((1, 2), SamplingParams(max_new_tokens=4, seed=1, n=2))
    weights = list(_model(1).state_dict().items())
    # sync: generate, then update
    engine.generate([req])
    engine.update_weights([weights], version=1)
    # colocated: release -> resume weights -> sync -> resume the rest -> probe; a checkpoint; a skipped sync
    colocation = Colocation(engine, _Trainers(engine, []), PhaseTimer(), offload_trainer=True, check=True)
    colocation.start()
    for version in (2, 3):
        engine.generate([req])
        colocation.to_training()
        colocation.sync(version)
        with colocation.trainer_state_loaded():
            pass
    colocation.to_training()
    colocation.resume()
    # partial: two retract syncs while a long generation runs
    partial = RemoteEngine([SGLangClient(server.url, retry=FAST)], pause_mode="retract")
    thread, out = _in_background(lambda: engine.generate(
        [GenerateRequest((3,), SamplingParams(max_new_tokens=200, ignore_eos=True, seed=2))]))
    for version, tokens in ((4, 10), (5, 40)):
        _wait_for_tokens(server.engine, tokens)
        partial.update_weights([weights], version=version)
    thread.join(60)
    assert out["result"][0].token_versions()[-1] == 5
    assert server.crashed is None and not [c for c in calls if c[1] >= 500]
    paths = [p for p, _ in calls]
    assert paths.count("/release_memory_occupation") == 5 and paths.count("/resume_memory_occupation") == 7
    for e in (engine, partial):
        e.shutdown()
