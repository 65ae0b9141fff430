"""LR schedules: warmup + constant / cosine and the response-length-surge decay (math_spec §g.3)."""

import math

import pytest
import torch

from megatron_rl.lr_schedules import LRSchedule, LRScheduleConfig, set_lr


def _trace(k):
    return 1000.0 if k < 110 else 3500.0


def test_warmup_constant_and_cosine():
    s = LRSchedule(LRScheduleConfig(lr=1.0, warmup_steps=4))
    assert [s.step() for _ in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    c = LRSchedule(LRScheduleConfig(kind="cosine", lr=1.0, min_lr=0.1, warmup_steps=2, total_steps=12))
    lrs = [c.step() for _ in range(14)]
    assert lrs[:2] == [0.5, 1.0]
    assert lrs[7] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[12] == pytest.approx(0.1) and lrs[13] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))


def test_length_surge_oracle():
    """g.3: L̄ = 1000 for 110 steps then 3500 ⇒ surge at step 110, P = 198, η = η0/2 at step 308,
    floor 0.1·η0 reached after 4 halvings."""
    s = LRSchedule(LRScheduleConfig(kind="length_surge", lr=1e-6, warmup_steps=10))
    lrs = [s.step(_trace(k)) for k in range(1200)]
    assert s.state.surge_step == 110 and s.state.period == 198 and s.state.base_length == 1000.0
    assert lrs[0] == pytest.approx(1e-7) and lrs[9] == pytest.approx(1e-6) and lrs[109] == 1e-6
    assert lrs[110] == 1e-6 and lrs[307] == 1e-6 and lrs[308] == pytest.approx(5e-7)
    assert lrs[110 + 3 * 198] == pytest.approx(1.25e-7) and lrs[110 + 4 * 198 - 1] == pytest.approx(1.25e-7)
    assert lrs[110 + 4 * 198] == pytest.approx(1e-7) and lrs[-1] == pytest.approx(1e-7)


def test_length_surge_state_metrics():
    s = LRSchedule(LRScheduleConfig(kind="length_surge", lr=1e-6, warmup_steps=10))
    seen = []
    for k in range(120):
        s.step(_trace(k))
        seen.append(s.metrics())
    assert seen[5] == {"schedule/decaying": 0.0}  # still measuring the baseline
    assert seen[100]["schedule/base_length"] == 1000.0 and seen[100]["schedule/decaying"] == 0.0
    assert seen[100]["schedule/surge_threshold"] == pytest.approx(1000.0 * s.cfg.surge_factor)
    assert seen[119]["schedule/decaying"] == 1.0
    assert LRSchedule(LRScheduleConfig(kind="cosine", lr=1.0, total_steps=5)).metrics() == {}


def test_resume_mid_decay_reproduces_the_sequence():
    cfg = LRScheduleConfig(kind="length_surge", lr=1.0, warmup_steps=10, patience=2)
    ref = LRSchedule(cfg)
    full = [ref.step(_trace(k)) for k in range(700)]
    a = LRSchedule(cfg)
    first = [a.step(_trace(k)) for k in range(400)]
    sd = a.state_dict()
    b = LRSchedule(cfg)
    b.load_state_dict(sd)
    rest = [b.step(_trace(k)) for k in range(400, 700)]
    assert first + rest == full and b.state.surge_step == 111  # patience 2: fires on the second surging step
    with pytest.raises(ValueError, match="surge_factor"):
        LRSchedule(LRScheduleConfig(kind="length_surge", lr=1.0, surge_factor=2.0)).load_state_dict(sd)


def test_no_surge_keeps_constant_and_other_shapes():
    s = LRSchedule(LRScheduleConfig(kind="length_surge", lr=1.0))
    assert set(s.step(1000.0 + k) for k in range(300)) == {1.0}
    e = LRSchedule(LRScheduleConfig(kind="length_surge", lr=1.0, decay_shape="exponential", floor_ratio=0.0))
    lrs = [e.step(_trace(k)) for k in range(408)]
    assert lrs[110 + 99] == pytest.approx(2 ** -0.5) and lrs[308] == pytest.approx(0.5)
    early = LRSchedule(LRScheduleConfig(kind="length_surge", lr=1.0, baseline_steps=2, min_period=10))
    lrs = [early.step(100.0 if k < 2 else 1000.0) for k in range(25)]
    assert early.state.period == 10 and lrs[12] == 0.5  # ⌈1.8·2⌉ = 4 clamped to P_min = 10
    with pytest.raises(ValueError, match="mean_response_length"):
        LRSchedule(LRScheduleConfig(kind="length_surge")).step()


def test_re_trigger_restarts_decay_from_the_current_lr():
    cfg = LRScheduleConfig(kind="length_surge", lr=1.0, baseline_steps=10, period_factor=1.0, cooldown_steps=5,
                           re_trigger=True, floor_ratio=0.0)
    s = LRSchedule(cfg)
    lengths = [100.0] * 10 + [400.0] * 30 + [1300.0] * 10
    lrs = [s.step(x) for x in lengths]
    assert lrs[10] == 1.0 and lrs[20] == 0.5 and lrs[39] == 0.25  # first surge at 10, P = 10
    # 1300 > 3 × 400 at step 40: the decay restarts from the LR step 40 had (0.125) with P = 40
    assert s.state.surge_step == 40 and s.state.period == 40 and lrs[40] == lrs[49] == 0.125


def test_identical_lr_from_a_global_length_and_set_lr():
    opt = torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)]},
                           {"params": [torch.zeros(1, requires_grad=True)], "lr_mult": 0.1}], lr=1.0)
    set_lr(opt, 2e-6)
    assert [g["lr"] for g in opt.param_groups] == [2e-6, pytest.approx(2e-7)]
