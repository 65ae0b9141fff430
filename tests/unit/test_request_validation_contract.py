"""The embedded server refuses and accepts the same ``sampling_params`` as SGLang 0.5.23's own code (its JSON
contract gate, ``SamplingParams`` and ``verify``, run in the SGLang venv by ``tests/sglang_side/validate_requests.py``),
with SGLang's status and error shape, over a table of bad values; the few differences are listed with their reason."""

import pytest

from megatron_rl.rollout.client import wire
from megatron_rl.rollout.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
from megatron_rl.rollout.embedded.server import EmbeddedServer

from rollout_models import VOCAB, tiny_qwen3
from test_sglang_contract import run_side, sglang_python  # noqa: F401 - the fixture
from test_server_hardening import _post

NAN, INF = float("nan"), float("inf")

# (sampling_params, SGLang's status, ours; the reason when they differ)
CASES = [
    ({"top_k": 1e20}, 400, 400, None),
    ({"top_k": 10 ** 20}, 200, 200, None),  # ours: clipped to SGLang's "whole vocabulary" 2**30
    ({"top_k": 2 ** 63}, 200, 200, None),
    ({"top_k": -5}, 400, 400, None),
    ({"top_k": 0}, 400, 400, None),
    ({"top_k": -1}, 200, 200, None),
    ({"temperature": NAN}, 400, 400, None),
    ({"temperature": -1}, 400, 400, None),
    ({"temperature": 1e-45}, 200, 200, None),  # greedy
    ({"temperature": INF}, 400, 400, None),
    ({"temperature": "0.5"}, 400, 400, None),
    ({"temperature": 0, "top_k": -5}, 200, 200, None),  # greedy overrides top_k before verify
    ({"top_p": 0}, 400, 400, None),
    ({"top_p": 1.5}, 400, 400, None),
    ({"top_p": NAN}, 400, 400, None),
    ({"min_p": -0.1}, 400, 400, None),
    ({"min_p": 2}, 400, 400, None),
    ({"min_p": NAN}, 400, 400, None),
    ({"stop_token_ids": 3}, 400, 400, None),
    ({"stop_token_ids": ["a"]}, 400, 400, None),
    ({"stop_token_ids": [2.5]}, 400, 400, None),
    ({"stop_token_ids": [10 ** 30]}, 200, 200, None),  # can never match: dropped
    ({"stop_token_ids": [-1]}, 200, 200, None),
    ({"max_new_tokens": -1}, 400, 400, None),
    ({"max_new_tokens": 1e3}, 400, 400, None),
    ({"max_new_tokens": 2 ** 63 - 1}, 200, 400, "SGLang refuses it after verify, at its context-length check"),
    ({"max_new_tokens": 0}, 200, 400, "the embedded engine generates at least one token"),
    ({"n": 0}, 200, 400, "the embedded server needs n >= 1 samples"),
    ({"n": -1}, 200, 400, "the embedded server needs n >= 1 samples"),
    ({"n": 1.5}, 400, 400, None),
    ({"n": 2}, 200, 200, None),
    ({"repetition_penalty": 0}, 400, 400, None),
    ({"repetition_penalty": 2.5}, 400, 400, None),
    ({"repetition_penalty": 1.5}, 200, 400, "penalties are not implemented by the embedded engine"),
    ({"frequency_penalty": 3}, 400, 400, None),
    ({"frequency_penalty": 1.5}, 200, 400, "penalties are not implemented by the embedded engine"),
    ({"presence_penalty": -3}, 400, 400, None),
    ({"regex": "a+", "json_schema": "{}"}, 400, 400, None),
    ({"regex": "a+"}, 200, 400, "grammars are not implemented by the embedded engine"),
    ({"sampling_seed": 2 ** 64}, 400, 400, None),
    ({"sampling_seed": "x"}, 400, 400, None),
    ({"sampling_seed": -5}, 200, 200, None),
    ({"ignore_eos": "yes"}, 400, 400, None),
    ({"min_new_tokens": -1}, 400, 400, None),
    ({"min_new_tokens": 5, "max_new_tokens": 2}, 400, 400, None),
    ({"beam_width": 0}, 400, 400, None),
    ({"logit_bias": {"100": 1.0}}, 400, 400, None),
    ({"stop": ["x"] * 40}, 400, 400, None),
]


@pytest.fixture(scope="module")
def verdicts(sglang_python):  # noqa: F811
    bodies = [{"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, **sp} if "max_new_tokens" not in sp
               else sp} for sp, *_ in CASES]
    sglang = run_side(sglang_python, "validate_requests.py",
                      {"vocab_size": VOCAB, "requests": [{"endpoint": "/generate", "body": b} for b in bodies]})
    server = EmbeddedServer(EmbeddedEngine(tiny_qwen3(), EmbeddedEngineConfig(seeds="deterministic"))).start()
    try:
        ours = [_post(server, "/generate", b) for b in bodies]
    finally:
        server.stop()
    return sglang, ours


def test_our_validation_accepts_and_refuses_what_sglang_does(verdicts):
    sglang, ours = verdicts
    for (sp, sglang_status, our_status, reason), theirs, (status, payload) in zip(CASES, sglang, ours):
        assert (theirs["status"], status) == (sglang_status, our_status), (sp, theirs, payload)
        assert (sglang_status == our_status) == (reason is None), sp
        if sglang_status == our_status == 400:
            # the same shape: the contract's {"error": "..."}, or verify's {"error": {"message": ...}}
            assert isinstance(payload["error"], str) == (theirs["stage"] == "contract"), (sp, theirs, payload)
            message = wire.error_message(payload)
            assert any(f"sampling_params.{key}" in message for key in sp), (sp, message)
            if theirs["stage"] != "contract":  # verify's own words, after the field
                assert theirs["error"].split(",")[0].split(" got")[0] in message, (sp, theirs["error"], message)
