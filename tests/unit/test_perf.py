"""Throughput / MFU figures (megatron_rl.perf) and the profiler capture (megatron_rl.profiling)."""

import json
import os

import pytest
import torch

from megatron_rl import perf
from megatron_rl.models.config import HFArch
from megatron_rl.profiling import Capture, ProfileConfig
from multiproc import TINY_MODELS, _TINY_COMMON


def _hf(model_type, **overrides):
    import transformers

    cfg_cls, model_cls, extra = TINY_MODELS[model_type]
    config = getattr(transformers, cfg_cls)(**{**_TINY_COMMON, **extra, **overrides})
    return config, getattr(transformers, model_cls)(config)


@pytest.mark.parametrize("model_type", ["qwen3", "llama", "qwen3_moe"])
def test_active_matmul_parameters_match_the_hf_model(model_type):
    config, model = _hf(model_type, tie_word_embeddings=True)
    flops = perf.ModelFlops.from_arch(HFArch.from_hf(config))
    total = 0
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            total += m.weight.numel()
    experts = 0
    if config.model_type == "qwen3_moe":  # fused expert tensors (top-k of them active) and the router
        for name, p in model.named_parameters():
            if ".experts." in name:
                experts += p.numel() * config.num_experts_per_tok // config.num_experts
            elif name.endswith("mlp.gate.weight"):
                experts += p.numel()
    # the output layer counts once even when tied (it is a matmul whatever the weight's origin)
    assert flops.linear_params == total + experts
    assert flops.attn_dim == config.num_attention_heads * config.head_dim


def test_forward_flops_formula():
    f = perf.ModelFlops(linear_params=1000, layers=2, attn_dim=8)
    # two sequences of 3 and 5 tokens: 2*N*8 + 2*L*d*(9 + 25)
    assert f.forward(8, perf.sum_sq([3, 5])) == 2 * 1000 * 8 + 2 * 2 * 8 * 34


def test_gpu_table_and_order_of_matching():
    assert perf.gpu_table_peak("NVIDIA H200", torch.bfloat16) == 989e12
    assert perf.gpu_table_peak("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert perf.gpu_table_peak("NVIDIA H100 80GB HBM3", torch.float32) == 494e12
    assert perf.gpu_table_peak("NVIDIA H20", torch.bfloat16) == 148e12
    assert perf.gpu_table_peak("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312e12
    assert perf.gpu_table_peak("Some Future GPU", torch.bfloat16) is None


def test_cpu_peak_is_measured_once_per_process(monkeypatch, tmp_path):
    calls = []
    real = perf.measure_matmul_flops
    monkeypatch.setattr(perf, "measure_matmul_flops", lambda *a, **k: calls.append(1) or real(*a[:2], seconds=0.03))
    monkeypatch.setenv("MEGATRON_RL_PEAK_FILE", str(tmp_path / "peak.json"))  # no calibration
    perf._measured.cache_clear()
    first = perf.device_peak_flops(torch.float32, torch.device("cpu"))
    second = perf.device_peak_flops(torch.float32, torch.device("cpu"))
    assert first["source"] == second["source"] and first["source"].startswith("measured") and len(calls) == 1
    assert second["peak_flops"] == first["peak_flops"] > 1e8  # any CPU does > 0.1 GFLOP/s
    perf._measured.cache_clear()


def test_cpu_peak_from_the_calibration_file(monkeypatch, tmp_path):
    """A calibration file gives the same reference to every run on this machine (a start-up measurement follows
    the load); it is keyed by CPU, threads and dtype, so another thread count measures again."""
    monkeypatch.setenv("MEGATRON_RL_PEAK_FILE", str(tmp_path / "sub" / "peak.json"))
    r = perf.calibrate(torch.float32, seconds=0.05)
    assert r["peak_flops"] > 1e8 and os.path.isfile(r["file"])
    got = perf.device_peak_flops(torch.float32, torch.device("cpu"))
    assert got["peak_flops"] == r["peak_flops"] and got["source"] == f"calibrated: {r['file']}"
    assert perf.calibrated_peak(r["device"], torch.float64) is None
    assert perf.calibrated_peak(r["device"] + "x", torch.float32) is None


def test_step_metrics_definitions():
    flops = perf.ModelFlops(linear_params=10_000, layers=2, attn_dim=16)
    m = {"time/step": 10.0, "time/rollout": 4.0, "time/logprobs": 1.0, "time/train": 3.0, "time/weight_sync": 0.5,
         "time/reward": 1.0, "train/tokens": 1200.0, "rollout/response_tokens": 800.0, "rollout/prompt_tokens": 400.0,
         "rollout/seq_len_sq_sum": 20_000.0, "perf/train_flops": 3e9, "perf/logprob_flops": 1e9}
    dev = perf.Devices(trainer=2, engine=1, colocated=False)
    out = perf.step_metrics(m, flops, dev, peak_flops=1e11)
    assert out["perf/tokens_per_s_per_gpu"] == pytest.approx(1200 / (10 * 3))
    assert out["perf/train_tokens_per_s_per_gpu"] == pytest.approx(1200 / (3 * 2))
    assert out["perf/rollout_tokens_per_s_per_gpu"] == pytest.approx(800 / 4)
    assert out["perf/trainer_idle_frac"] == pytest.approx(1 - 4.5 / 10)
    assert out["perf/engine_idle_frac"] == pytest.approx(1 - 4.5 / 10)
    rollout = 2 * 10_000 * 1200 + 2 * 2 * 16 * 20_000
    assert out["perf/model_tflop"] == pytest.approx((rollout + 4e9) / 1e12)
    assert out["perf/mfu"] == pytest.approx((rollout + 4e9) / (10 * 3 * 1e11))
    assert out["perf/train_mfu"] == pytest.approx(3e9 / (3 * 2 * 1e11))
    assert out["perf/rollout_mfu"] == pytest.approx(rollout / (4 * 1 * 1e11))
    # colocated: the engines share the trainers' devices
    out = perf.step_metrics(m, flops, perf.Devices(2, 2, True), peak_flops=None)
    assert out["perf/tokens_per_s_per_gpu"] == pytest.approx(1200 / 20) and "perf/mfu" not in out


def test_profile_config_errors_and_capture(tmp_path):
    with pytest.raises(ValueError, match="profile.steps"):
        ProfileConfig(steps=[0])
    with pytest.raises(ValueError, match="profile.trainer_ranks"):
        ProfileConfig(trainer_ranks=[-1])
    cap = Capture()
    path = str(tmp_path / "step_1" / "trainer_rank0.json")
    cap.start(path)
    torch.mm(torch.randn(64, 64), torch.randn(64, 64))
    assert cap.stop() == path and cap.stop() is None
    events = json.load(open(path))["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)
