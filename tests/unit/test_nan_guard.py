"""The NaN guard's bound on Adam(W)'s step (megatron_rl.training.nan_guard): sound against the real torch
optimizer under adversarial gradients, and decisive where it matters (absurd lr / decay, huge weights,
narrow dtypes). The guarded step itself (skips and rollbacks leave weights and Adam state bitwise
untouched) is exercised with real Megatron optimizers in tests/distributed/test_train_step.py
(non-finite gradients) and test_checkpoint_reliability.py (lr 1e30: rolled back)."""

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.training import nan_guard


def _wrap(opt):
    return SimpleNamespace(optimizer=opt)  # Megatron's optimizers hold the torch one as .optimizer


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.95), (0.0, 0.99), (0.5, 0.3)])
def test_bound_holds_for_adamw_under_adversarial_gradients(betas):
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 64, generator=g, dtype=torch.float64))
    lr, wd = 0.3, 0.1
    opt = torch.optim.AdamW([p], lr=lr, betas=betas, weight_decay=wd, eps=1e-30)
    c = nan_guard.adam_update_bound(*betas)
    worst = 0.0
    for t in range(300):
        # bursts of huge gradients after long quiet stretches push |m|/sqrt(v) to its worst
        scale = 1e12 if t % 50 == 49 else 1e-12
        sign = torch.sign(torch.randn(p.shape, generator=g)) if t % 7 else 1.0
        p.grad = sign * scale * torch.rand(p.shape, generator=g, dtype=torch.float64)
        before = p.detach().clone()
        opt.step()
        # AdamW: p <- p (1 - lr wd) - lr * update; the update is bounded by C
        update = (before * (1 - lr * wd) - p.detach()).abs().max().item() / lr
        worst = max(worst, update)
        assert update <= c * (1 + 1e-9), (t, update, c)
    assert worst > 0.01 * c  # not vacuous: within two orders of magnitude of what the optimizer reaches


def test_bound_decides_where_overflow_is_possible():
    p = torch.nn.Parameter(torch.ones(8))
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01)
    max_abs = float(nan_guard.max_abs_weight(_wrap(opt)))
    assert max_abs == 1.0
    assert nan_guard.step_cannot_overflow(_wrap(opt), max_abs, [p])
    opt.param_groups[0]["lr"] = 1e37  # absurd: lr * C overflows float32
    assert not nan_guard.step_cannot_overflow(_wrap(opt), max_abs, [p])
    opt.param_groups[0].update(lr=1e30, weight_decay=1e10)  # the decay factor overflows (the rollback test's case)
    assert not nan_guard.step_cannot_overflow(_wrap(opt), max_abs, [p])
    opt.param_groups[0].update(lr=1e-3, weight_decay=0.01)
    assert not nan_guard.step_cannot_overflow(_wrap(opt), float("inf"), [p])  # already non-finite
    assert not nan_guard.step_cannot_overflow(_wrap(opt), 3e4, [p.half()])  # fp16 model weights: 65504 max
    assert nan_guard.step_cannot_overflow(_wrap(opt), 3e3, [p.half()])
    opt.param_groups[0]["betas"] = (0.99, 0.9)  # beta1^2 >= beta2: no bound, the exact path is taken
    assert not nan_guard.step_cannot_overflow(_wrap(opt), max_abs, [p])
