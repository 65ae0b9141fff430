"""The planner's cost model: a hand-computed step, monotonic properties, calibration that reproduces the run it
was measured on, and the candidates / CLI."""

import json
import math

import pytest

from megatron_rl.bench.workload import LengthDist, Workload
from megatron_rl.perf import ModelFlops
from megatron_rl.plan import calibration, planner
from megatron_rl.plan.cost_model import (Efficiency, Layout, ModelShape, PlanWorkload, predict, trainer_seconds,
                                         trainer_terms)
from megatron_rl.plan.devices import VENDOR, Device

SHAPE = ModelShape(ModelFlops(linear_params=10**9, layers=10, attn_dim=1000), params=1e9, active=1e9, kv_dim=100,
                   layers=10, num_experts=0, bytes_per_param=2, hidden=1000)
DEV = Device("X", peak_flops=1e15, hbm_bytes_per_s=1e12, intra_gb_per_s=100.0, inter_gb_per_s=10.0,
             memory_gib=80.0, per_node=8)
EFF = Efficiency(base_mfu=0.5, trainer_passes=4.0, decode_bw_eff=1.0, decode_flop_eff=1.0, rollout_scale=1.0,
                 sync_overhead_s=1.0, other_per_seq_s=0.01, handoff_s=2.0)


def _work(prompt="fixed:100", response="fixed:100", prompts=2, samples=2):
    w = Workload.parse(prompt, response)
    return PlanWorkload(prompts, samples, w.prompt, w.response)


def test_hand_computed_step():
    # 2 prompts x 2 samples of 100 + 100 tokens; 2 colocated trainers (tp1, dp2), 1 engine; sync
    p = predict(SHAPE, _work(), Layout(trainers=2, engines=1), DEV, EFF)
    # rollout: 100 decode steps x 2e9 weight bytes, plus the KV read 4 seq x 100 tok x (100 + 50) ctx x 10 layers
    # x 100 x 2 bytes, over 1e12 B/s; plus forward FLOPs 2e9 x 800 + 2 x 10 x 1000 x 4 x 200^2 over 1e15
    fwd = 2e9 * 800 + 2 * 10 * 1000 * 4 * 200.0 ** 2
    rollout = (100 * 2e9 + 4 * 100 * 150 * 10 * 100 * 2) / 1e12 + fwd / 1e15
    # trainer: 4 passes over 2 devices at 50 % MFU, plus the dp=2 all-reduce 2 x 1/2 x 2e9 B over 100 GB/s and two
    # collective latencies (2e-5 s), plus the host overhead: each rank's 2 sequences of 200 tokens are one micro-batch
    # (16384-token budget), 10 layers x (1e-4 s forward-only + 3e-4 s train)
    trainer = 4 * fwd / (2 * 1e15 * 0.5) + 2e9 / 100e9 + 2 * 2e-5 + 10 * 1e-4 + 10 * 3e-4
    sync = 1.0 + 2e9 / (100e9 * 0.7)
    other = 0.01 * 4 + 2.0
    assert p.phases["rollout"] == pytest.approx(rollout, rel=1e-12)
    assert p.phases["trainer"] == pytest.approx(trainer, rel=1e-12)
    assert p.phases["weight_sync"] == pytest.approx(sync, rel=1e-12)
    assert p.step_s == pytest.approx(rollout + trainer + sync + other, rel=1e-12)
    assert p.step_s == pytest.approx(3.3007474, rel=1e-7)  # by hand: 0.2017232 + 0.0304528 + 1.0285714 + 2.04
    assert p.tokens_per_s_per_gpu == pytest.approx(800 / (p.step_s * 2), rel=1e-12)
    # disaggregated one-step overlaps rollout and trainer: max instead of the sum, no hand-over
    q = predict(SHAPE, _work(), Layout(trainers=2, engines=1, placement="disaggregated", mode="one_step"), DEV, EFF)
    assert q.step_s == pytest.approx(max(rollout, trainer) + sync + 0.04, rel=1e-12)
    # tp=2 (dp=1): the FLOPs at 0.92 x the MFU; each rank's 4 sequences (800 tokens) one micro-batch; per pass
    # 4 x 10 + 3 = 43 collectives of 2e-5 s plus 4 x 10 x (800 tokens x 1000 x 2 bytes / 2) over 100 GB/s;
    # the forward-only pass once, the train micro-batch twice (forward and backward)
    t = predict(SHAPE, _work(), Layout(tp=2, trainers=2, engines=1), DEV, EFF)
    tp_pass = 43 * 2e-5 + 40 * 800 * 1000 * 2 / 2 / 100e9
    want = 4 * fwd / (2 * 1e15 * 0.5 * 0.92) + 10 * 1e-4 + 10 * 3e-4 + 3 * tp_pass
    assert t.phases["trainer"] == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx(0.0145104, rel=1e-5)  # 0.0069704 + 0.004 + 3 x 0.00118


@pytest.mark.parametrize("gpu", ["H100", "B200"])
def test_more_gpus_never_slower_and_longer_responses_never_faster(gpu):
    from megatron_rl.models.config import HFArch
    from transformers import Qwen3Config

    arch = HFArch.from_hf(Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                      num_attention_heads=32, num_key_value_heads=8, head_dim=128))
    shape, dev = ModelShape.from_arch(arch), VENDOR[gpu]
    work = _work("fixed:512", "lognormal:mean=2048,sigma=0.6,cap=8192", prompts=32, samples=8)
    if dev.memory_gib < 128:  # 8B x 16 B/param of trainer state: not on one 80 GB GPU
        assert not planner.rank(shape, work, dev, Efficiency(), 1)
    best = [planner.rank(shape, work, dev, Efficiency(), n)[0].step_s for n in (2, 3, 4, 8, 16)]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(best, best[1:])), best
    assert best[-1] < best[0] / 4  # and it does use them
    for lay in (Layout(trainers=8, engines=8), Layout(tp=2, trainers=4, engines=4, placement="disaggregated",
                                                       mode="async", staleness=2)):
        times = [predict(shape, _work("fixed:512", f"fixed:{r}", 32, 8), lay, dev, Efficiency()).step_s
                 for r in (128, 512, 2048, 8192)]
        assert times == sorted(times) and times[0] < times[-1], times


def test_calibration_reproduces_the_measured_run():
    """A sync run's own medians -> calibration -> the prediction of that run is its measured step time."""
    work, lay = _work(), Layout(tp=1, trainers=2, engines=1)
    fwd = SHAPE.flops.forward(800, 4 * 200.0 ** 2)
    med = {"time/step": 9.0, "time/rollout": 3.0, "time/logprobs": 0.5, "time/train": 1.5, "time/weight_sync": 0.7,
           "time/engine_memory": 0.2, "time/trainer_memory": 0.1, "train/tokens": 800.0,
           "rollout/seq_len_sq_sum": 4 * 200.0 ** 2, "perf/train_flops": 3 * fwd, "perf/logprob_flops": fwd}
    eff = calibration.calibrate(med, SHAPE, work, lay, DEV)
    assert eff.trainer_passes == pytest.approx(4.0)
    assert predict(SHAPE, work, lay, DEV, eff).step_s == pytest.approx(9.0, rel=1e-12)
    assert eff.other_per_seq_s == pytest.approx((9.0 - 3.0 - 2.0 - 0.7 - 0.3) / 4)
    # the host overheads are what each phase took beyond its FLOPs at the prior MFU (and its communication)
    terms = trainer_terms(SHAPE, work, lay, DEV, eff)
    assert eff.base_mfu == Efficiency().base_mfu and eff.forward_passes == pytest.approx(1.0)
    assert terms["flops"] / 4 + terms["fwd_overhead"] == pytest.approx(0.5, rel=1e-12)
    assert 3 * terms["flops"] / 4 + terms["train_overhead"] + terms["dp"] == pytest.approx(1.5, rel=1e-12)
    # a run faster than the prior MFU allows: a higher MFU and no overhead; on a CPU with TP (collectives, shared
    # cores) the run is reproduced too
    one_rank = Layout(trainers=1, engines=1)
    fast = calibration.calibrate({**med, "time/logprobs": 1e-3, "time/train": 3e-3}, SHAPE, work, one_rank, DEV)
    assert fast.fwd_layer_s == fast.train_layer_s == 0.0 and fast.base_mfu > Efficiency().base_mfu
    assert trainer_seconds(SHAPE, work, one_rank, DEV, fast) == pytest.approx(4e-3, rel=1e-9)
    cpu = Device("cpu", 1e11, 2e10, 5.0, 1.0, 8.0, 64, collective_latency_s=3e-4, cores=2, background_cores=0.5)
    tp2 = Layout(tp=2, trainers=2, engines=1)
    eff = calibration.calibrate(med, SHAPE, work, tp2, cpu)
    assert predict(SHAPE, work, tp2, cpu, eff).step_s == pytest.approx(9.0, rel=1e-12)
    # one rank alone: no collectives, a core to itself (2 ranks got 1.5 / 2 of one each), the same overheads
    one = trainer_terms(SHAPE, work, Layout(trainers=1, engines=1), cpu, eff)
    both = trainer_terms(SHAPE, work, tp2, cpu, eff)
    assert one["fwd_tp"] == 0.0 and both["fwd_tp"] > 0
    assert one["fwd_overhead"] == pytest.approx(both["fwd_overhead"] * 0.75, rel=1e-12)


def test_calibration_file_round_trip_and_errors(tmp_path):
    eff = Efficiency(base_mfu=0.3, rollout_scale=2.0, fwd_layer_s=0.25)
    path = str(tmp_path / "calibration.json")
    calibration.save(path, eff, {"device": "cpu"})
    back = calibration.load(path)
    assert (back.base_mfu, back.rollout_scale, back.fwd_layer_s) == (0.3, 2.0, 0.25)
    assert back.mfu(1, 1) == pytest.approx(0.3) and back.mfu(2, 1) == pytest.approx(0.3 * 0.92)
    (tmp_path / "bad.json").write_text(json.dumps({"x": 1}))
    with pytest.raises(ValueError, match="--calibration=.*bad.json.*not a calibration.json"):
        calibration.load(str(tmp_path / "bad.json"))


def test_candidates_respect_divisibility_and_memory():
    lays = list(planner.candidates(8, SHAPE, DEV))
    assert all(lay.devices <= 8 and lay.trainers % (lay.tp * lay.pp) == 0 and SHAPE.layers % lay.pp == 0
               for lay in lays)
    assert not any(lay.mode != "sync" and lay.placement == "colocated" for lay in lays)
    big = ModelShape(SHAPE.flops, params=20e9, active=20e9, kv_dim=100, layers=10, num_experts=0)
    preds = planner.rank(big, _work(), DEV, EFF, 8)
    # 16 B/param of trainer state = 298 GiB over tp x pp shards of at most 0.9 x 80 GiB: tp x pp >= 8
    assert preds and all(p.layout.tp * p.layout.pp >= 8 for p in preds)
    assert not planner.rank(big, _work(), DEV, EFF, 4)


def test_workload_specs():
    assert LengthDist.parse(7).expected() == (7.0, 49.0)
    d = LengthDist.parse("lognormal:mean=100,sigma=0.5,cap=1000")
    mean, sq = d.expected()
    assert mean == pytest.approx(100, rel=0.01) and sq > mean ** 2
    assert math.isclose(d.draw(20000, __import__("numpy").random.default_rng(0)).mean(), mean, rel_tol=0.02)
    with pytest.raises(ValueError, match="bench.response_len='gamma:3'"):
        Workload.parse("fixed:4", "gamma:3")
    with pytest.raises(ValueError, match="lognormal"):
        LengthDist.parse("lognormal:sigma=1", "x")


def test_plan_cli(tmp_path, capsys):
    from megatron_rl.cli import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "qwen3", "vocab_size": 32000, "hidden_size": 2048,
                               "intermediate_size": 6144, "num_hidden_layers": 16, "num_attention_heads": 16,
                               "num_key_value_heads": 4, "head_dim": 128}))
    assert main(["plan", str(cfg), "--gpus", "16", "--gpu", "H200", "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "| 1 |" in out and "recommended:" in out and "assumptions:" in out and "H200" in out
    ranked = json.loads((tmp_path / "p.json").read_text())
    assert [r["step_s"] for r in ranked] == sorted(r["step_s"] for r in ranked)
    assert main(["plan", str(cfg), "--gpus", "4", "--gpu", "A7"]) == 2
    assert "--gpu='A7': unknown device" in capsys.readouterr().err
