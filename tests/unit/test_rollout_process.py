"""Rollout servers as child processes: a server killed mid-request, restart policy, SGLang launch errors."""

import threading
import time

import pytest
import torch

from megatron_rl.rollout.client.http_client import RetryPolicy, ServerUnavailableError
from megatron_rl.rollout.client.process import ServerLaunchError, launch_embedded_server
from megatron_rl.rollout.client.protocol import GenerateRequest, SamplingParams
from megatron_rl.rollout.client.sglang import SGLANG_VERSION, SGLangServerConfig, check_sglang_installed, launch_sglang_server

from rollout_models import tiny_qwen3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3")
    tiny_qwen3().save_pretrained(path)
    return path


REQ = GenerateRequest((4, 5, 6), SamplingParams(max_new_tokens=10, seed=3, ignore_eos=True))


def _kill_while_in_flight(server, client):
    """Pause the server so the request is provably in flight (accepted, waiting), then SIGKILL it."""
    client.pause_generation(mode="in_place")
    out = {}

    def run():
        try:
            out["samples"] = client.generate_one(REQ)
        except Exception as e:  # noqa: BLE001
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.5)
    assert thread.is_alive()
    server.kill()
    thread.join(120)
    assert not thread.is_alive()
    return out


def test_killed_server_is_restarted_and_the_request_retried(model_dir, tmp_path):
    from megatron_rl.rollout.embedded.engine import EmbeddedEngine
    from transformers import AutoModelForCausalLM

    expected = EmbeddedEngine(AutoModelForCausalLM.from_pretrained(model_dir)).generate([REQ])[0]
    server = launch_embedded_server(str(model_dir), str(tmp_path / "server.log"))
    try:
        client = server.client(retry=RetryPolicy(max_attempts=3, backoff_s=0.1, restart_dead_server=True))
        out = _kill_while_in_flight(server, client)
        assert "error" not in out, out.get("error")
        assert server.restarts == 1 and server.alive()
        sample = out["samples"][0]
        assert sample.response_ids == expected.response_ids  # seeded: same answer from the fresh server
        assert torch.allclose(torch.tensor(sample.logprobs), torch.tensor(expected.logprobs), atol=1e-5)
    finally:
        server.stop()
    assert not server.alive()


def test_killed_server_without_restart_policy_fails_clearly(model_dir, tmp_path):
    server = launch_embedded_server(str(model_dir), str(tmp_path / "server.log"))
    try:
        client = server.client(retry=RetryPolicy(max_attempts=2, backoff_s=0.1))
        out = _kill_while_in_flight(server, client)
        err = out["error"]
        assert isinstance(err, ServerUnavailableError)
        assert server.url in str(err) and "failed after 2 attempt(s)" in str(err) and "restart" in str(err)
        assert server.restarts == 0
    finally:
        server.stop()


def test_embedded_server_launch_failure_shows_log_tail(tmp_path):
    with pytest.raises(ServerLaunchError) as info:
        launch_embedded_server(str(tmp_path / "no_such_model"), str(tmp_path / "server.log"))
    assert "exited with code" in str(info.value) and "no_such_model" in str(info.value)


def test_sglang_config_renders_flags():
    cfg = SGLangServerConfig(model_path="/models/qwen3-moe", tp_size=2, mem_fraction_static=0.6,
                             enable_return_routed_experts=True, sampling_backend="pytorch", random_seed=1,
                             enable_deterministic_inference=True, extra_args=("--disable-radix-cache",))
    argv = cfg.argv(port=31000)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    joined = " ".join(argv)
    for flag in ("--model-path /models/qwen3-moe", "--tp-size 2", "--mem-fraction-static 0.6", "--port 31000",
                 "--host 127.0.0.1", "--enable-return-routed-experts", "--sampling-backend pytorch",
                 "--skip-tokenizer-init", "--random-seed 1", "--disable-radix-cache",
                 "--enable-deterministic-inference"):
        assert flag in joined, flag
    assert "--enable-deterministic-inference" not in SGLangServerConfig(model_path="m").argv(port=1)
    with pytest.raises(ValueError, match="mem_fraction_static"):
        SGLangServerConfig(model_path="m", mem_fraction_static=1.5)
    with pytest.raises(ValueError, match="tp_size"):
        SGLangServerConfig(model_path="m", tp_size=0)


def _sglang_installed():
    try:
        check_sglang_installed()
        return True
    except ImportError:
        return False


@pytest.mark.skipif(_sglang_installed(), reason="checks the failure path, needs sglang absent")
def test_sglang_missing_fails_fast_and_launch_failure_has_log_tail(tmp_path):
    with pytest.raises(ImportError, match=f"pip install sglang=={SGLANG_VERSION}"):
        launch_sglang_server(SGLangServerConfig(model_path="m"))
    cfg = SGLangServerConfig(model_path="m", log_path=str(tmp_path / "sglang.log"), health_timeout_s=60)
    with pytest.raises(ServerLaunchError) as info:
        launch_sglang_server(cfg, check_installed=False)
    assert "No module named 'sglang'" in str(info.value) and str(tmp_path / "sglang.log") in str(info.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not _sglang_installed(), reason="needs a GPU and sglang")
def test_real_sglang_round_trip(tmp_path):
    """Launch SGLang on a small HF model directory given by $MEGATRON_RL_SGLANG_TEST_MODEL."""
    import os

    model = os.environ.get("MEGATRON_RL_SGLANG_TEST_MODEL")
    if not model:
        pytest.skip("set MEGATRON_RL_SGLANG_TEST_MODEL to a local HF model directory")
    # SGLang honours sampling_seed only with --enable-deterministic-inference, whatever the sampling backend
    cfg = SGLangServerConfig(model_path=model, mem_fraction_static=0.3, enable_deterministic_inference=True,
                             log_path=str(tmp_path / "sglang.log"))
    with launch_sglang_server(cfg) as server:
        client = server.client()
        a = client.generate_one(GenerateRequest((1, 2, 3), SamplingParams(max_new_tokens=8, seed=1)))[0]
        b = client.generate_one(GenerateRequest((1, 2, 3), SamplingParams(max_new_tokens=8, seed=1)))[0]
        assert a.response_ids == b.response_ids and len(a.logprobs) == len(a.response_ids)


def test_a_port_taken_before_the_server_binds_it_is_replaced(model_dir, tmp_path, monkeypatch, caplog):
    """free_port's port can be bound by another process before the server starts: the launch tries a new one (CI
    saw "Address already in use" fail a whole run); a port the caller chose is not replaced."""
    import socket

    from megatron_rl.rollout.client import process

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    ports = iter([busy])
    real = process.free_port
    monkeypatch.setattr(process, "free_port", lambda host="127.0.0.1": next(ports, None) or real(host))
    try:
        with caplog.at_level("WARNING", logger=process.__name__):
            server = launch_embedded_server(str(model_dir), str(tmp_path / "server.log"))
        try:
            assert server.url != f"http://127.0.0.1:{busy}" and server.alive()
            assert f"port {busy} was taken" in caplog.text
        finally:
            server.stop()
        with pytest.raises(ServerLaunchError, match="Address already in use"):
            launch_embedded_server(str(model_dir), str(tmp_path / "server2.log"), port=busy)
    finally:
        taken.close()
