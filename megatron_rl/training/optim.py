"""Megatron DDP + optimizer construction, and the guarded optimizer step (skip on non-finite).

The step is split the way Megatron's own ``optimizer.step()`` is split internally
(``prepare_grads`` -> grad norm -> clip -> ``step_with_ready_grads``) so that the decision to skip can
include the loss, taken on the last pipeline stage, and is made identically on every rank with one
all-reduce. A skipped step never reaches ``step_with_ready_grads``: parameters and optimizer state
(moments, step counts) stay bitwise unchanged.

Finite gradients can still give non-finite weights (an absurd learning rate or decay). Before the step,
:mod:`megatron_rl.training.nan_guard` bounds the weights Adam can produce from ``max|w|`` (one fused
reduction on the verdict's all-reduce, whatever the gradients): when the bound is far below overflow, as
in any sane run, the step is taken with no copy and no check. Otherwise the weights are checked after the
step (one all-reduce); with ``optim.nonfinite_weights="rollback"`` the step is undone from a host-memory
copy of everything it writes (model and main parameters, Adam moments and counters: ~4x the parameters'
bytes), so it counts as skipped exactly like a non-finite gradient; with ``"stop"`` (no copy) the run
stops with an error instead.
"""

from __future__ import annotations

import math
from typing import Iterable, List, Tuple

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, clip_grads, get_megatron_optimizer

from megatron_rl.config.train import OptimConfig
from megatron_rl.training import fused_optim, nan_guard


def build_ddp_and_optimizer(module, tconfig, cfg: OptimConfig):
    """Wrap ``module`` (this rank's GPTModel stage) in Megatron DDP and build the Megatron optimizer."""
    ddp_cfg = DistributedDataParallelConfig(
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        grad_reduce_in_fp32=True,  # bf16 models still accumulate and reduce gradients in fp32
        overlap_grad_reduce=False,
        average_in_collective=False,
    )
    ddp = DistributedDataParallel(tconfig, ddp_cfg, module)
    # Data-parallel all-reduce / reduce-scatter, SP norm and tied-embedding grads, once per schedule.
    tconfig.finalize_model_grads_func = finalize_model_grads
    opt_cfg = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        bf16=tconfig.bf16,
        fp16=tconfig.fp16,
        params_dtype=tconfig.params_dtype,
    )
    optimizer = get_megatron_optimizer(opt_cfg, [ddp], use_gloo_process_groups=not torch.cuda.is_available())
    fused_optim.install(optimizer)  # no per-tensor loops and host syncs without TE / Apex
    if tconfig.fp16:
        tconfig.grad_scale_func = optimizer.scale_loss  # dynamic loss scaling of the fp16 optimizer
    return ddp, optimizer


def _leaf_optimizers(optimizer):
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _clip(optimizer, max_norm: float, total_norm: float) -> None:
    for opt in _leaf_optimizers(optimizer):
        if getattr(opt, "is_stub_optimizer", False):
            continue
        params = opt.get_parameters()
        if params:
            # looked up at call time: the CPU compatibility layer wraps it (megatron_rl/compat/)
            clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=max_norm, total_norm=total_norm,
                                                    use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)


class _Snapshot:
    """Host copies of every tensor an optimizer step writes; :meth:`restore` puts them back bitwise."""

    def __init__(self, optimizer, params: Iterable[torch.Tensor]):
        tensors: List[torch.Tensor] = list(params)
        self.group_steps = []
        self.stateless = []  # (optimizer, param) without state yet: the step creates it, the restore removes it
        for leaf in _leaf_optimizers(optimizer):
            inner = getattr(leaf, "optimizer", None)
            if inner is None or getattr(leaf, "is_stub_optimizer", False):
                continue
            for group in inner.param_groups:
                self.group_steps.append((group, group.get("step")))
                for p in group["params"]:
                    tensors.append(p)
                    state = inner.state.get(p)
                    if state:
                        tensors += [v for v in state.values() if torch.is_tensor(v)]
                    else:
                        self.stateless.append((inner, p))
        unique = {id(t): t for t in tensors}
        self.saved = [(t, t.detach().to("cpu", copy=True)) for t in unique.values()]

    @torch.no_grad()
    def restore(self) -> None:
        for t, copy in self.saved:
            t.copy_(copy)
        for group, step in self.group_steps:
            if step is not None:
                group["step"] = step
        for inner, p in self.stateless:
            inner.state.pop(p, None)


def _all_finite(params: Iterable[torch.Tensor]) -> bool:
    """Whether every rank's parameters are finite (collective)."""
    bad = torch.tensor([0.0 if all(bool(torch.isfinite(p).all()) for p in params) else 1.0])
    if dist.get_backend() == "nccl":
        bad = bad.cuda()
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bool(bad.item())


def guarded_step(optimizer, clip_grad: float, loss_is_finite: bool, params: Iterable[torch.Tensor] = (),
                 rollback: bool = True) -> Tuple[bool, float, bool]:
    """Prepare gradients, compute the global grad norm, and step unless anything is non-finite.

    Collective over the whole job (call it on every rank). ``loss_is_finite`` is this rank's verdict on
    the loss (ranks without a loss pass True). ``params``: the model parameters, checked after the step; a
    step that makes them non-finite is undone (``rollback``) or raises ``FloatingPointError``. Returns
    ``(applied, grad_norm before clipping, weights_were_nonfinite)``.
    """
    found_inf = optimizer.prepare_grads()  # fp16: unscales, checks for inf; fp32: grads into place
    grad_norm = float(optimizer.get_grad_norm())
    params = list(params)
    # max|w| rides on the verdict's all-reduce: no extra collective or host sync for the weight bound
    bad = torch.stack([torch.tensor(0.0 if loss_is_finite else 1.0, dtype=torch.float64),
                       torch.tensor(float(found_inf), dtype=torch.float64),
                       torch.tensor(0.0 if math.isfinite(grad_norm) else 1.0, dtype=torch.float64),
                       nan_guard.max_abs_weight(optimizer).cpu() if params else torch.zeros((), dtype=torch.float64)])
    if dist.get_backend() == "nccl":
        bad = bad.cuda()
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    verdict = bad.tolist()
    if any(verdict[:3]):
        return False, grad_norm, False
    if clip_grad > 0:
        _clip(optimizer, clip_grad, grad_norm)
    if not params or nan_guard.step_cannot_overflow(optimizer, verdict[3], params):
        # the bound proves the step keeps every weight finite: no copy, no check after it
        optimizer.step_with_ready_grads()
        return True, grad_norm, False
    snapshot = _Snapshot(optimizer, params) if rollback else None
    optimizer.step_with_ready_grads()
    if _all_finite(params):
        return True, grad_norm, False
    if snapshot is None:
        raise FloatingPointError(
            f"the optimizer step made the weights non-finite (gradient norm {grad_norm:.4g} was finite): the "
            "learning rate is too large for this model; resume from the last checkpoint with a lower optim.lr, "
            "or set optim.nonfinite_weights=rollback to skip such steps")
    snapshot.restore()
    return False, grad_norm, True


def zero_grads(ddp, optimizer) -> None:
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
