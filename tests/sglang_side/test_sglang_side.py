"""Self-test of the SGLang-side scripts, in the SGLang venv only (see conftest.py):

    .venv-sglang/bin/python -m pytest -q tests/sglang_side

The trainer/producer halves run in the main venv's python (torch 2.13) when `.venv` exists
(MAIN_PYTHON overrides), so the cross-version paths are the ones checked; else in this python.
"""

import base64
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import _common
import deserialize_tensors
import routed_experts
import validate_requests

HERE, ROOT = _common.HERE, _common.ROOT


def main_python() -> str:
    default = os.path.join(ROOT, ".venv", "bin", "python")
    return os.environ.get("MAIN_PYTHON", default if os.path.exists(default) else sys.executable)


def judge(endpoint, body, vocab_size=100, method="POST"):
    return validate_requests.judge({"endpoint": endpoint, "body": body, "method": method}, vocab_size)


def test_generate_accepted_and_dropped_keys_reported():
    r = judge("/generate", {"input_ids": [1, 2, 3], "rid": "a", "return_logprob": True,
                            "sampling_params": {"max_new_tokens": 4, "sampling_seed": 7},
                            "our_private_field": 1})
    assert r["ok"] and r["status"] == 200 and r["request_class"] == "GenerateReqInput"
    assert r["ignored_keys"] == ["our_private_field"]
    (child,) = r["expansion"]["children"]
    assert (child["rid"], child["rid_source"], child["sampling_seed"]) == ("a", "sent", 7)


def test_generate_n_children_get_fresh_rids_and_one_shared_seed():
    r = judge("/generate", {"input_ids": [1, 2, 3], "rid": "a",
                            "sampling_params": {"max_new_tokens": 4, "n": 3, "sampling_seed": 5}})
    e = r["expansion"]
    assert (e["parallel_sample_num"], e["prefix_warmup_requests"], len(e["children"])) == (3, 1, 3)
    rids = [c["rid"] for c in e["children"]]
    assert len(set(rids)) == 3 and "a" not in rids and not any(x.startswith("a_") for x in rids)
    assert {c["sampling_seed"] for c in e["children"]} == {5}
    unseeded = judge("/generate", {"input_ids": [1, 2], "sampling_params": {"n": 2}})
    assert [c["seed_if_deterministic"] for c in unseeded["expansion"]["children"]] == [42, 42]


def test_generate_batch_rid_prefix_is_suffixed():
    r = judge("/generate", {"input_ids": [[1, 2], [3]], "rid": "b", "sampling_params": {}})
    assert [(c["rid"], c["rid_source"]) for c in r["expansion"]["children"]] == [
        ("b_0", "suffixed"), ("b_1", "suffixed")]


@pytest.mark.parametrize("body,status,stage,needle", [
    ({"input_ids": [1], "sampling_params": {"bogus": 1}}, 400, "contract", "bogus"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0.0}}, 400, "sampling_params", "top_p"),
    ({"input_ids": [1], "sampling_params": {"logit_bias": {"100": 1.0}}}, 400, "sampling_params",
     "logit_bias"),
    ({"input_ids": [1], "token_ids_logprob": [100]}, 400, "token_ids_logprob", "out-of-vocabulary"),
    ({"input_ids": "1 2"}, 400, "validation", "input_ids"),
    ({"sampling_params": {}}, 400, "normalize", "input_ids"),
])
def test_generate_refusals(body, status, stage, needle):
    r = judge("/generate", body)
    assert (r["ok"], r["status"], r["stage"]) == (False, status, stage)
    assert needle in r["error"]


def test_admin_endpoints():
    ok = judge("/update_weights_from_distributed",
               {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "g",
                "flush_cache": False, "extra": 1})
    assert ok["ok"] and ok["ignored_keys"] == ["extra"] and ok["parsed"]["group_name"] == "g"
    missing = judge("/update_weights_from_distributed", {"names": ["w"], "dtypes": ["float32"]})
    assert (missing["status"], missing["stage"]) == (400, "validation") and "shapes" in missing["error"]
    assert judge("/get_weight_version", None, method="GET")["status"] == 404
    assert judge("/update_weights_from_distributed", {}, method="GET")["status"] == 405
    flush = judge("/flush_cache", {"timeout": 1})
    assert flush["ok"] and flush["ignored_keys"] == ["timeout"]  # a query parameter, not a body field
    for endpoint, body in [("/begin_weight_update", {}), ("/end_weight_update", {}),
                           ("/pause_generation", {"mode": "abort"}), ("/continue_generation", {}),
                           ("/abort_request", {"abort_all": True}),
                           ("/release_memory_occupation", {"tags": ["kv_cache", "weights"]}),
                           ("/resume_memory_occupation", {"tags": ["weights"]}),
                           ("/update_weight_version", {"new_version": "3"}),
                           ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                           "rank_offset": 1, "world_size": 2,
                                                           "backend": "gloo"}),
                           ("/destroy_weights_update_group", {"group_name": "g"})]:
        r = judge(endpoint, body)
        assert r["ok"] and r["ignored_keys"] == [], (endpoint, r)


def test_routed_experts_capture_encode_decode():
    # 3 positions, 4 decoder layers of which 1 and 3 are MoE, top-2
    layer1, layer3 = [[0, 5], [2, 3], [7, 1]], [[4, 4], [6, 0], [1, 2]]
    out = routed_experts.encode({"capture": {"num_hidden_layers": 4, "topk": 2,
                                             "layers": {"1": layer1, "3": layer3}}})
    full = np.zeros((3, 4, 2), dtype=np.int32)
    full[:, 1], full[:, 3] = layer1, layer3
    assert out["shape"] == [3, 4, 2] and out["decoded"] == full.tolist()
    assert out["meta_info"]["routed_experts"] == base64.b64encode(full.tobytes()).decode()
    tail = routed_experts.encode({"routed_experts": full.tolist(), "start_len": 1})
    assert tail["decoded"] == full[1:].tolist()
    assert routed_experts.decode(out["meta_info"]["routed_experts"])["decoded_flat"] == full.ravel().tolist()


def _emit_payload(strategy, load_format, tp_size=2):
    """A producer process (main venv's torch when present) holding its tensors until stdin closes."""
    proc = subprocess.Popen(
        [main_python(), os.path.join(HERE, "probe_tensor_payload.py"), "--emit", "--strategy", strategy,
         "--load-format", load_format, "--tp-size", str(tp_size)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, json.loads(proc.stdout.readline())


@pytest.mark.parametrize("load_format", ["none", "flattened_bucket"])
def test_tensor_payload_file_system_strategy(load_format):
    proc, emitted = _emit_payload("file_system", load_format)
    try:
        for tp_rank, expected in enumerate(emitted["expected"]):
            got = deserialize_tensors.decode(emitted["body"], tp_rank)
            assert got["ok"], got
            assert got["tensors"] == expected
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


def test_tensor_payload_file_descriptor_strategy_is_refused():
    proc, emitted = _emit_payload("file_descriptor", "none", tp_size=1)
    try:
        got = deserialize_tensors.decode(emitted["body"], 0)
        assert (got["ok"], got["stage"]) == (False, "deserialize")
        assert "AuthenticationError" in got["error"]
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


def test_weight_group_broadcast_meets_sglang_rank():
    proc = subprocess.run(
        [main_python(), os.path.join(HERE, "probe_weight_group.py"), "--sglang-python", sys.executable],
        capture_output=True, text=True, timeout=600)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ok"], (report, proc.stderr[-3000:])
    assert [b["load_format"] for b in report["buckets"]] == [None, "flattened_bucket"]
