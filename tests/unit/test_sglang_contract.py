"""Our SGLang side judged by SGLang 0.5.23's own code (tests/sglang_side/, run in the SGLang venv).

* every request body our client sends on the SGLang path -- generation (n samples, seeds, processed
  log-probs, routed experts, prompt log-probs), the weight-update session, the weight group, flush,
  version, pause/continue, abort, memory -- goes through SGLang's route validation, request classes and
  sampling-parameter checks: all accepted, no field silently dropped;
* our trainer rank 0 (``weight_group.create_weight_group`` + the balancer's announce/broadcast) feeds a real
  SGLang ``WeightUpdater`` that joined through ``init_custom_process_group``: the tensors it receives equal ours;
* the colocated transport's ``/update_weights_from_tensor`` payloads decode in SGLang's deserializer and
  weight updater to our tensors, in both load formats;
* SGLang's routed-experts capture/encoding decodes with ours to the experts it captured, and our server
  encodes them as SGLang does.

The SGLang venv comes from ``scripts/setup_sglang_venv.sh`` (``scripts/test.sh`` builds it and sets
``MEGATRON_RL_REQUIRE_SGLANG=1``, so in CI these tests cannot skip).
"""

import json
import os
import subprocess

import pytest
import torch

from megatron_rl.rollout.client import wire
from megatron_rl.weights import tensor_payload
from megatron_rl.rollout.client.balancer import RemoteEngine
from megatron_rl.rollout.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
from megatron_rl.rollout.client.http_client import RequestRejected, SGLangClient
from megatron_rl.rollout.client.protocol import ExpertLayout, GenerateRequest, SamplingParams
from megatron_rl.rollout.embedded.server import EmbeddedServer

from rollout_models import tiny_qwen3, tiny_qwen3_moe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIDE = os.path.join(ROOT, "tests", "sglang_side")
VOCAB = 96  # rollout_models' vocabulary


@pytest.fixture(scope="module")
def sglang_python() -> str:
    path = os.environ.get("SGLANG_PYTHON") or os.path.join(ROOT, os.environ.get("SGLANG_VENV", ".venv-sglang"),
                                                           "bin", "python")
    if os.path.exists(path):
        return path
    message = f"the SGLang venv is missing ({path}): bash scripts/setup_sglang_venv.sh"
    if os.environ.get("MEGATRON_RL_REQUIRE_SGLANG") == "1":
        pytest.fail(message)
    pytest.skip(message)


def run_side(python: str, script: str, payload, timeout: float = 600):
    proc = subprocess.run([python, os.path.join(SIDE, script)], input=json.dumps(payload), capture_output=True,
                          text=True, timeout=timeout, cwd=SIDE)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


class Recording(SGLangClient):
    """Our client, every call recorded (method, path, body) on its way to the embedded server."""

    def __init__(self, url: str, log: list, **kw):
        super().__init__(url, **kw)
        self.log = log

    def with_url(self, url):
        return Recording(url, self.log, timeout_s=self.timeout_s, expert_layout=self.expert_layout,
                         logprob_mode=self.logprob_mode)

    def request(self, method, path, body=None, timeout_s=None, idempotent=True):
        self.log.append({"endpoint": path, "method": method, "body": body})
        return super().request(method, path, body, timeout_s, idempotent)


class SGLangRank(Recording):
    """Our client whose weight-group calls are answered by SGLang's own ``WeightUpdater`` (``weight_group_rank.py``):
    ``/init_weights_update_group`` starts it with the body's arguments (it joins through
    ``init_custom_process_group``), each ``/update_weights_from_distributed`` body is handed to it and answered with
    its result, ``/destroy_weights_update_group`` ends it. Once joined, the update session, ``/flush_cache`` and
    pause/continue are answered by SGLang's own ``SchedulerWeightUpdaterManager`` and ``Scheduler`` code
    (``scheduler_stub.py``). ``/server_info`` and ``/update_weight_version`` get SGLang's success answer."""

    ANSWERED = ("/begin_weight_update", "/end_weight_update", "/flush_cache", "/pause_generation",
                "/continue_generation")

    def __init__(self, python: str, log: list):
        super().__init__("http://127.0.0.1:9", log, timeout_s=300)  # never connected
        self.python, self.proc, self.events = python, None, []

    def request(self, method, path, body=None, timeout_s=None, idempotent=True):
        self.log.append({"endpoint": path, "method": method, "body": body})
        if path in ("/server_info", "/get_server_info"):
            return {"tp_size": 1, "pp_size": 1}
        if path == "/init_weights_update_group":
            args = ["--master-address", body["master_address"], "--master-port", str(body["master_port"]),
                    "--rank-offset", str(body["rank_offset"]), "--world-size", str(body["world_size"]),
                    "--group-name", body["group_name"], "--backend", body["backend"], "--deadline-s", "300"]
            self.proc = subprocess.Popen([self.python, os.path.join(SIDE, "weight_group_rank.py"), *args], cwd=SIDE,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            return self._answer("joined")
        if path == "/update_weights_from_distributed":
            self._send(path, body)
            return self._answer("bucket")
        if path in self.ANSWERED and self.proc is not None:
            self._send(path, body)
            return self._answer("answer")
        if path == "/destroy_weights_update_group":
            self.proc.stdin.close()
            answer = self._answer("destroyed")
            self.proc.wait(60)
            return answer
        return {"success": True, "message": "Success"}

    def hold(self) -> None:
        """A request starts running on the rank's scheduler (not a request of ours: not logged)."""
        self._send("/_hold", {})
        self._answer("answer")

    def _send(self, path: str, body) -> None:
        self.proc.stdin.write(json.dumps({"endpoint": path, "body": body}) + "\n")
        self.proc.stdin.flush()

    def _answer(self, event: str):
        line = self.proc.stdout.readline()
        assert line, f"weight_group_rank.py ended before its {event!r} event (exit {self.proc.poll()})"
        got = json.loads(line)
        assert got["event"] == event, got
        self.events.append(got)
        if not got["success"]:
            raise RequestRejected(f"{self.url} -> {got.get('status', 400)}: {got['message']}", self.url,
                                  got.get("status", 400), got)
        return {"success": True, "message": got["message"]}


def _summary(t: torch.Tensor) -> dict:
    t64 = t.detach().to(torch.float64)
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "sum": float(t64.sum()),
            "sumsq": float((t64 * t64).sum())}


def _buckets():
    g = torch.Generator().manual_seed(0)
    one_dtype = [("model.layers.0.mlp.up_proj.weight", torch.randn(8, 6, generator=g)),
                 ("model.norm.weight", torch.randn(6, generator=g))]  # float32: flattened_bucket
    mixed = [("a.bias", torch.randn(3, generator=g).to(torch.bfloat16)),  # offset 6 bytes: float32 cannot follow
             ("b.weight", torch.randn(4, 5, generator=g)), ("c.weight", torch.randn(2, 2, generator=g).half())]
    return [one_dtype, mixed]


@pytest.fixture(scope="module")
def session(sglang_python):
    """Everything our client sends on the SGLang path, the weight sync answered by SGLang's engine rank."""
    log: list = []
    layout = ExpertLayout(moe_layers=(True, False, True), topk=2)
    dense = EmbeddedServer(EmbeddedEngine(tiny_qwen3(), EmbeddedEngineConfig(seeds="deterministic"))).start()
    moe = EmbeddedServer(EmbeddedEngine(tiny_qwen3_moe(dense_layers=(1,)),
                                        EmbeddedEngineConfig(seeds="deterministic"))).start()
    try:
        processed = Recording(dense.url, log, logprob_mode="processed")
        engine = RemoteEngine([processed], weight_transport="distributed", pause_mode="in_place")
        engine.generate([
            GenerateRequest((1, 2, 3), SamplingParams(max_new_tokens=4, seed=7, n=3, top_p=0.9, top_k=20,
                                                      temperature=0.8, stop_token_ids=(5,)),
                            return_top_logprobs=2, rid="grp-0", return_sampling_logprobs=True),
            GenerateRequest((4, 5), SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))])
        engine.prompt_logprobs([1, 2, 3, 4])
        engine.release_memory(["kv_cache", "cuda_graph"])
        engine.resume_memory(["kv_cache", "cuda_graph"])
        engine.release_memory()
        engine.resume_memory()
        processed.pause_generation("in_place")
        processed.pause_generation("retract")
        processed.continue_generation()
        processed.abort_request("grp-0")
        processed.abort_request(abort_all=True)
        processed.server_info()
        processed.model_info()
        engine.shutdown()

        routed = Recording(moe.url, log, expert_layout=layout)
        moe_engine = RemoteEngine([routed])
        moe_engine.generate([GenerateRequest((1, 2, 3), SamplingParams(max_new_tokens=3, seed=1),
                                             return_routed_experts=True)])
        moe_engine.prompt_logprobs_and_routes([1, 2, 3, 4])
        moe_engine.shutdown()

        rank = SGLangRank(sglang_python, log)
        sync = RemoteEngine([rank], weight_transport="distributed", pause_mode="retract")
        sync.init_weight_sync("127.0.0.1", 0, backend="gloo", timeout_s=300)
        buckets = _buckets()
        rank.hold()  # a generation runs on the rank: the retract sync flushes anyway
        sync.update_weights(buckets, version=3)
        sync.pause_mode = "in_place"  # one in-place sync over a running generation: SGLang refuses its flush
        rank.hold()
        sync.update_weights(buckets, version=4)
        sync.close_weight_sync()
        sync.shutdown()
    finally:
        dense.stop()
        moe.stop()
    judged = run_side(sglang_python, "validate_requests.py", {"vocab_size": VOCAB, "requests": log})
    return dict(log=log, judged=judged, events=rank.events, buckets=buckets, flush_refused=sync.flush_refused)


def test_every_request_we_send_is_accepted_by_sglang_with_no_field_dropped(session):
    endpoints = {r["endpoint"] for r in session["log"]}
    assert {"/generate", "/begin_weight_update", "/end_weight_update", "/init_weights_update_group",
            "/update_weights_from_distributed", "/destroy_weights_update_group", "/flush_cache",
            "/update_weight_version", "/pause_generation", "/continue_generation", "/abort_request",
            "/release_memory_occupation", "/resume_memory_occupation"} <= endpoints
    for sent, verdict in zip(session["log"], session["judged"]):
        assert verdict["ok"] and verdict["status"] == 200, (sent, verdict)
        assert not verdict.get("ignored_keys"), (sent, verdict)


def test_n_samples_go_as_one_batch_of_one_sample_items_with_their_own_seeds_and_rids(session):
    """A prompt's n samples: one /generate in SGLang's batch form, which its tokenizer manager splits into n
    requests of one sample, each keeping the rid and the seed we sent (with n > 1 SGLang would seed every child
    alike under deterministic inference and give them fresh rids)."""
    generate = [(s, v) for s, v in zip(session["log"], session["judged"])
                if s["endpoint"] == "/generate" and "grp-0-0" in (s["body"].get("rid") or [])]
    assert len(generate) == 1
    (sent, verdict), = generate
    expansion = verdict["expansion"]
    assert (expansion["batch_size"], expansion["parallel_sample_num"], expansion["prefix_warmup_requests"]) == (3, 1, 0)
    children = expansion["children"]
    assert [c["rid"] for c in children] == ["grp-0-0", "grp-0-1", "grp-0-2"]
    assert all(c["rid_source"] == "sent" for c in children)
    seeds = [c["sampling_seed"] for c in children]
    assert len(set(seeds)) == 3 and None not in seeds
    assert [c["seed_if_deterministic"] for c in children] == seeds
    assert sent["body"].get("return_sampling_mask")  # processed log-probs, filtered


def test_our_weight_group_feeds_sglangs_weight_updater_bit_exactly(session):
    events = session["events"]
    assert events[0]["event"] == "joined" and events[0]["success"]
    received = [e for e in events if e["event"] == "bucket"]
    assert [e["success"] for e in received] == [True] * 4  # two syncs
    for bucket, got in zip(session["buckets"] * 2, received):
        assert got["tensors"] == {name: _summary(t) for name, t in bucket}
    assert events[-1]["event"] == "destroyed" and events[-1]["success"]
    announces = [r["body"] for r in session["log"] if r["endpoint"] == "/update_weights_from_distributed"]
    assert [a.get("load_format") for a in announces] == ["flattened_bucket", None] * 2
    assert all(a["flush_cache"] is False for a in announces)
    order = [r["endpoint"] for r in session["log"]]
    sync = order[order.index("/init_weights_update_group"):]  # the dense/MoE servers never synced
    one = ["/pause_generation", "/begin_weight_update", "/update_weights_from_distributed",
           "/update_weights_from_distributed", "/end_weight_update", "/flush_cache", "/update_weight_version",
           "/continue_generation"]
    assert sync == ["/init_weights_update_group", *one, *one, "/destroy_weights_update_group"]
    assert [r["body"]["mode"] for r in session["log"] if r["endpoint"] == "/pause_generation"][-2:] == [
        "retract", "in_place"]


def test_partial_syncs_flush_under_sglangs_own_retract_and_idleness_rules(session):
    """N1 judged by SGLang's Scheduler.pause_generation / flush_cache / is_fully_idle and its session manager: with
    a request running, the retract sync's flush succeeds; the in-place sync's is refused (counted by the balancer)."""
    answers = [(e["endpoint"], e["status"]) for e in session["events"] if e["event"] == "answer"]
    assert [a for a in answers if a[0] == "/flush_cache"] == [("/flush_cache", 200), ("/flush_cache", 400)]
    assert answers.count(("/begin_weight_update", 200)) == 2 and answers.count(("/end_weight_update", 200)) == 2
    assert session["flush_refused"] == [1]


@pytest.mark.parametrize("load_format", [tensor_payload.FLATTENED, None])
def test_colocated_tensor_payloads_decode_in_sglang_to_our_tensors(sglang_python, load_format):
    tp = 2
    buckets = _buckets()
    payloads, jobs = [], []
    for bucket in buckets:
        per_rank = [tensor_payload.encode_bucket(bucket, load_format) for _ in range(tp)]  # one pickle per rank
        payloads.append(per_rank)
        body = tensor_payload.request_body([p.text for p in per_rank], load_format)
        jobs += [{"body": body, "tp_rank": r} for r in range(tp)]
    results = run_side(sglang_python, "deserialize_tensors.py", jobs)  # producer alive: the payloads hold shm
    for k, result in enumerate(results):
        assert result["ok"] and result["status"] == 200, result
        bucket = buckets[k // tp]
        assert [{k2: v for k2, v in t.items() if k2 != "name"} for t in result["tensors"]] == \
            [_summary(t) for _, t in bucket]
        assert [t["name"] for t in result["tensors"]] == [name for name, _ in bucket]


def test_routed_experts_round_trip_through_sglangs_capture(sglang_python):
    layout = ExpertLayout(moe_layers=(True, False, True, True), topk=2)
    g = torch.Generator().manual_seed(1)
    tokens = 5
    captured = {i: torch.randint(0, 8, (tokens, 2), generator=g, dtype=torch.int32) for i in layout.moe_indices}
    out = run_side(sglang_python, "routed_experts.py", {"capture": {
        "num_hidden_layers": layout.num_layers, "topk": layout.topk,
        "layers": {str(i): t.tolist() for i, t in captured.items()}}})
    b64 = out["meta_info"]["routed_experts"]
    ours = wire.decode_routed(b64, layout)
    assert torch.equal(ours, torch.stack([captured[i] for i in layout.moe_indices], dim=1))
    full = torch.zeros(tokens, layout.num_layers, layout.topk, dtype=torch.int32)
    for i, t in captured.items():
        full[:, i] = t
    assert wire.encode_routed(full) == b64  # the embedded server's encoding is SGLang's


def test_our_launch_command_lines_parse_in_sglangs_own_parser(sglang_python, tmp_path):
    """What `sglang.launch_server` would do with our command lines before anything else: SGLang's own
    `ServerArgs.add_cli_args` parser. Every option on; and the GPU recipes' engines, seeded or not, with the
    values they set arriving as SGLang reads them."""
    from megatron_rl.config import build_run_config, resolve_mapping
    from megatron_rl.orchestration.engine_worker import EngineSpec
    from megatron_rl.rollout.client.sglang import SGLangServerConfig

    def launch_args(cfg: SGLangServerConfig) -> list:
        argv = cfg.argv(port=31000)
        assert argv[1:3] == ["-m", "sglang.launch_server"]
        return argv[3:]

    everything = SGLangServerConfig(model_path="/m", tp_size=2, mem_fraction_static=0.6, random_seed=1,
                                    enable_return_routed_experts=True, enable_memory_saver=True,
                                    sampling_backend="pytorch", enable_deterministic_inference=True,
                                    extra_args=("--disable-radix-cache",))
    cases = {"everything": everything}
    data = tmp_path / "math.jsonl"
    data.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    for name in ("qwen3_dense", "qwen3_moe", "deepseek_v3"):
        for seeded in (False, True):
            cfg = build_run_config(resolve_mapping(os.path.join(ROOT, "examples", f"{name}.yaml"), [
                f"data.path={data}", f"eval.data.path={data}", f"rollout.seeded={str(seeded).lower()}"]))
            r = cfg.rollout
            spec = EngineSpec(kind="sglang", model_path=cfg.model.hf_path, deterministic=r.deterministic_inference,
                              seed=cfg.seed, routed_experts=cfg.train.routing_replay, sglang=r.sglang)
            cases[f"{name}/seeded={seeded}"] = spec.sglang_server()
    out = run_side(sglang_python, "server_args.py", {"argvs": [launch_args(c) for c in cases.values()]})["parsed"]
    bogus = run_side(sglang_python, "server_args.py", {"argvs": [["--model-path", "/m", "--no-such-flag"]]})
    assert not bogus["parsed"][0]["ok"] and "--no-such-flag" in bogus["parsed"][0]["error"]  # the check can fail
    for (name, cfg), parsed in zip(cases.items(), out):
        assert parsed["ok"], (name, parsed.get("error"))
        got = parsed["args"]
        assert (got["model_path"], got["tp_size"], got["dtype"], got["host"], got["port"]) == (
            cfg.model_path, cfg.tp_size, cfg.dtype, cfg.host, 31000), name
        assert got["mem_fraction_static"] == cfg.mem_fraction_static and got["random_seed"] == cfg.random_seed
        assert got["enable_deterministic_inference"] is cfg.enable_deterministic_inference, name
        assert got["enable_return_routed_experts"] is cfg.enable_return_routed_experts, name
        assert got["enable_memory_saver"] is cfg.enable_memory_saver and got["skip_tokenizer_init"] is True
    assert out[0]["args"]["sampling_backend"] == "pytorch" and out[0]["args"]["disable_radix_cache"] is True
    recipes = dict(zip(cases, out))
    assert recipes["qwen3_moe/seeded=False"]["args"]["enable_return_routed_experts"] is True
    assert recipes["deepseek_v3/seeded=False"]["args"]["enable_return_routed_experts"] is True
    assert recipes["qwen3_dense/seeded=True"]["args"]["enable_deterministic_inference"] is True
