"""The CPU compatibility layer covers a Megatron training step: DDP, finalize_model_grads, the Megatron
optimizer (plain and distributed), grad clipping, tied embeddings over pipeline stages, MoE alltoall.

Dist-checkpointing is not exercised here: its torch_dist writer starts a multiprocessing Manager,
which daemonic test ranks may not do (it works from non-daemonic ranks, e.g. Ray actors).
"""

from __future__ import annotations

import pytest
import torch

from multiproc import run_distributed, tiny_hf_checkpoint

import model_helpers  # noqa: F401  (warning filters for the ranks)

CASES = [  # (model type, HF overrides, layout, distributed optimizer)
    ("llama", {"tie_word_embeddings": True}, dict(pp=2), False),
    ("qwen3", {}, dict(tp=2), True),
    ("qwen3_moe", {}, dict(ep=2), True),
]


def _train_child(paths):
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_rl import parallel
    from megatron_rl.models.build import build_model
    from megatron_rl.models.config import ModelConfig

    out = {}
    ids = torch.randint(0, 250, (4, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12).expand(2, -1)
    for (model_type, _, layout, dist_opt), path in zip(CASES, paths):
        groups = parallel.init_megatron_parallel(parallel.ParallelLayout(**layout))
        built = build_model(ModelConfig(hf_path=path), groups)
        cfg = built.tconfig
        ddp = DistributedDataParallel(
            cfg, DistributedDataParallelConfig(use_distributed_optimizer=dist_opt), built.module
        )
        cfg.finalize_model_grads_func = finalize_model_grads
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=dist_opt, clip_grad=1.0),
            [ddp],
        )

        def step(data_iterator, model):
            tokens = next(data_iterator)
            logits = model(tokens, pos, attention_mask=None)  # [b, s, V/TP]

            def loss_func(o):
                loss = vocab_parallel_cross_entropy(o.transpose(0, 1).contiguous(), tokens.t().contiguous()).mean()
                return loss, {"loss": loss.detach().clone()}

            return logits, loss_func

        losses, norms = [], []
        for _ in range(3):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            store = get_forward_backward_func()(
                forward_step_func=step, data_iterator=iter(ids.split(2)), model=[ddp],
                num_microbatches=2, seq_length=12, micro_batch_size=2, forward_only=False,
            )
            ok, grad_norm, _ = opt.step()
            assert ok
            norms.append(grad_norm)
            if store:
                losses.append(torch.stack([d["loss"] for d in store]).mean().item())
        tied_in_sync = None
        if layout.get("pp", 1) > 1 and built.arch.tie_word_embeddings:
            # The two copies of the tied embedding (first and last stage) must stay identical.
            mine = built.module.shared_embedding_or_output_weight().detach().clone()
            other = mine.clone()
            dist.broadcast(other, src=dist.get_global_rank(groups.pp, 0), group=groups.pp)
            tied_in_sync = torch.equal(mine, other)
        out[f"{model_type}@{layout}"] = {"losses": losses, "grad_norms": norms, "tied_in_sync": tied_in_sync}
    return out


@pytest.mark.timeout(300)
def test_megatron_train_step_runs_on_cpu(tmp_path):
    paths = [
        tiny_hf_checkpoint(str(tmp_path / f"m{i}"), model_type, **overrides)
        for i, (model_type, overrides, _, _) in enumerate(CASES)
    ]
    results = run_distributed(_train_child, 2, paths, timeout_s=280)
    for rank, per_case in enumerate(results):
        for case, r in per_case.items():
            assert all(0 < n < float("inf") for n in r["grad_norms"]), (rank, case, r)
            if r["losses"]:
                assert r["losses"][-1] < r["losses"][0], (rank, case, r)
            if r["tied_in_sync"] is not None:
                assert r["tied_in_sync"], (rank, case)
