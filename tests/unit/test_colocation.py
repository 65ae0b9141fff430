"""Colocated SGLang on CPU: the embedded server's SGLang rules for memory tags and per-rank tensor payloads,
the order in which engines and trainer hand the GPUs to each other (``orchestration/colocation.py``) against
that server, engine GPU assignment, and the config checks."""

import json

import pytest
import torch

from megatron_rl.config import build_run_config, resolve_mapping
from megatron_rl.preflight import check_run_config
from megatron_rl.config_io import ConfigError
from megatron_rl.metrics import PhaseTimer
from megatron_rl.orchestration.colocation import Colocation
from megatron_rl.orchestration.placement import colocated_devices
from megatron_rl.weights import tensor_payload
from megatron_rl.rollout.client.balancer import RemoteEngine
from megatron_rl.rollout.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
from megatron_rl.rollout.client.http_client import RequestRejected, RetryPolicy, SGLangClient
from megatron_rl.rollout.client.protocol import GenerateRequest, SamplingParams
from megatron_rl.rollout.embedded.server import EmbeddedServer
from megatron_rl.weights.sync import SyncStats, compare_logprobs, probe_tokens

from rollout_models import VOCAB, other_weights, tiny_qwen3
from run_helpers import REPO

FAST = RetryPolicy(max_attempts=2, backoff_s=0.05)


@pytest.fixture
def server():
    s = EmbeddedServer(EmbeddedEngine(tiny_qwen3(), EmbeddedEngineConfig(seeds="deterministic")), tp_size=2).start()
    yield s
    s.stop()


def _generate(client):
    return client.generate_one(GenerateRequest((1, 2), SamplingParams(max_new_tokens=3, seed=1)))[0]


def test_tp_payloads_and_memory_tags_follow_sglang(server):
    """A server of TP 2 takes one payload per rank (each the whole bucket); a weight update while its weights are
    released is refused (SGLang would write into unmapped memory), generation while any tag is released too."""
    client = SGLangClient(server.url, retry=FAST)
    assert client.server_info()["tp_size"] == 2
    weights = other_weights(tiny_qwen3, seed=1)
    payloads = [tensor_payload.encode_bucket(weights) for _ in range(2)]
    client.begin_weight_update()
    try:
        with pytest.raises(RequestRejected, match="1 payload.s. for 2 TP rank.s."):
            client.update_weights_from_payloads([payloads[0].text], "flattened_bucket")
        client.release_memory_occupation()
        with pytest.raises(RequestRejected, match=r"resume_memory_occupation\(tags=\['weights'\]\) before updating"):
            client.update_weights_from_payloads([p.text for p in payloads], "flattened_bucket")
        client.resume_memory_occupation(["weights"])
        client.update_weights_from_payloads([p.text for p in payloads], "flattened_bucket")
        with pytest.raises(RequestRejected, match="resume_memory"):
            _generate(client)  # KV cache and CUDA graphs are still released
    finally:
        client.end_weight_update()
    client.resume_memory_occupation(["kv_cache", "cuda_graph"])
    ids = list(range(4, 20))
    target = EmbeddedEngine(tiny_qwen3(seed=1)).prompt_logprobs(ids)[0]
    torch.testing.assert_close(client.prompt_logprobs(ids), target, rtol=0, atol=1e-5)  # the new weights serve
    with pytest.raises(RequestRejected, match="joins a weight group as one rank"):
        client.init_weights_update_group("127.0.0.1", 1, 1, 3, "g")


class _Trainers:
    """The driver's TrainerGroup as Colocation sees it; its sync and check are the real HTTP calls (the
    trainer ranks' side of both is tested in tests/distributed/test_colocated_sync.py)."""

    def __init__(self, engine, log):
        self.engine, self.log = engine, log

    def offload(self):
        self.log.append(("trainer", "offload"))
        return {"memory/sync/cpu_rss_gib": 1.0}

    def reload(self):
        self.log.append(("trainer", "reload"))
        return {"memory/train/cpu_rss_gib": 2.0}

    def memory(self, prefix):
        self.log.append(("trainer", "memory"))
        return {prefix + "cpu_rss_gib": 3.0}

    def sync_weights(self, version, check):
        assert check is False  # checked later, once the KV cache is back
        self.engine.update_weights([other_weights(tiny_qwen3, seed=1)], version)
        return SyncStats(str(version), 0.0, 0.0, 0.0, 0, 1, 1, "float32")

    def check_weights(self, what):
        ids = probe_tokens(VOCAB, 8, 0)
        (lp,) = self.engine.prompt_logprobs(ids.tolist())  # generates: refused while the KV cache is released
        return compare_logprobs(lp, lp, 1e-4, ids, what)


def test_colocation_hands_memory_over_in_sglangs_order(server, monkeypatch):
    log = []
    dispatch = server.dispatch

    def record(method, path, body):
        if path not in ("/health", "/server_info"):
            log.append(("server", path, body.get("tags")))
        return dispatch(method, path, body)

    monkeypatch.setattr(server, "dispatch", record)
    engine = RemoteEngine([SGLangClient(server.url, retry=FAST)], weight_transport="tensor")
    colocation = Colocation(engine, _Trainers(engine, log), PhaseTimer(), offload_trainer=True, check=True)
    colocation.start()
    assert log == [("trainer", "offload")]
    log.clear()
    assert colocation.to_training() == {"memory/train/cpu_rss_gib": 2.0}
    assert log == [("server", "/release_memory_occupation", None), ("trainer", "reload")]
    log.clear()
    stats, memory = colocation.sync(7)
    assert log == [("trainer", "offload"), ("server", "/resume_memory_occupation", ["weights"]),
                   ("server", "/begin_weight_update", None), ("server", "/update_weights_from_tensor", None),
                   ("server", "/end_weight_update", None), ("server", "/flush_cache", None),
                   ("server", "/update_weight_version", None),
                   ("server", "/resume_memory_occupation", ["kv_cache", "cuda_graph"]),
                   ("server", "/generate", None), ("trainer", "memory")]
    assert stats.check.max_abs_diff == 0.0 and memory == {"memory/sync/cpu_rss_gib": 1.0,
                                                          "memory/rollout/cpu_rss_gib": 3.0}
    assert _generate(SGLangClient(server.url)).weight_version == "7"
    log.clear()
    with colocation.trainer_state_loaded():
        log.append(("trainer", "save_checkpoint"))
    assert log == [("server", "/release_memory_occupation", ["kv_cache", "cuda_graph"]), ("trainer", "reload"),
                   ("trainer", "save_checkpoint"), ("trainer", "offload"),
                   ("server", "/resume_memory_occupation", ["kv_cache", "cuda_graph"])]
    log.clear()
    colocation.resume()  # nothing is released any more
    assert log == []
    times = PhaseTimer()
    colocation.timer = times
    colocation.to_training()
    colocation.sync(8)
    assert {"engine_memory", "trainer_memory", "weight_sync"} <= set(times.seconds)


def test_colocated_engines_run_on_their_trainer_ranks_gpus():
    ids = [("node-a", ["4"]), ("node-a", ["5"]), ("node-a", ["6"]), ("node-a", ["7"]), ("node-b", ["0"]),
           ("node-b", ["1"])]
    assert colocated_devices(ids, 2, 3) == ["4,5", "6,7", "0,1"]
    assert colocated_devices(ids, 1, 2) == ["4", "5"]
    with pytest.raises(RuntimeError, match=r"engine 1 spans trainer ranks \[3, 4, 5\] on several nodes"):
        colocated_devices(ids, 3, 2)


def _gpu_recipe(tmp_path, *overrides):
    data = tmp_path / "math.jsonl"
    data.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    mapping = resolve_mapping(str(REPO / "examples" / "qwen3_dense.yaml"),
                              [f"data.path={data}", f"eval.data.path={data}", *overrides])
    cfg = build_run_config(mapping)
    check_run_config(cfg, files=False)
    return cfg


COLOCATED = ["rollout.placement=colocated", "rollout.sglang.enable_memory_saver=true"]


def test_colocated_sglang_is_accepted(tmp_path):
    cfg = _gpu_recipe(tmp_path, *COLOCATED)
    assert cfg.rollout.transport == "ipc" and cfg.rollout.offload_trainer is None
    cfg = _gpu_recipe(tmp_path, *COLOCATED, "rollout.num_engines=2", "rollout.sglang.tp_size=2")
    assert cfg.rollout.transport == "ipc"


@pytest.mark.parametrize("overrides,needles", [
    (["rollout.placement=colocated"], ["needs rollout.sglang.enable_memory_saver=true"]),
    (COLOCATED + ["rollout.weight_transport=distributed"],
     ["takes its weights by CUDA IPC", "not 'distributed'", "NCCL weight group cannot hold"]),
    (COLOCATED + ["rollout.sglang.tp_size=2"], ["rollout.num_engines=4 colocated SGLang servers of "
                                                "rollout.sglang.tp_size=2 GPUs need 8 trainer GPUs"]),
    (COLOCATED + ["cluster.gpus_per_trainer=0.5"], ["set cluster.gpus_per_trainer=1 (got 0.5)"]),
    (["rollout.weight_transport=ipc"], ["rollout.weight_transport='ipc'", "needs rollout.placement=colocated"]),
    (["rollout.offload_trainer=true"], ["rollout.offload_trainer=true", "set offload_trainer=false"]),
    (["rollout.engine=remote", "rollout.urls=[http://h:1]", "rollout.placement=colocated",
      "rollout.weight_transport=ipc"], ["remote servers take 'distributed'"]),
])
def test_unsupported_colocated_settings_are_named(tmp_path, overrides, needles):
    with pytest.raises(ConfigError) as e:
        _gpu_recipe(tmp_path, *overrides)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))
