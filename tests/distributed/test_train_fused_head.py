"""``train.fused_head``: the trainer's statistics from the output layer's input equal those from its logits.

Same batch, same layout, fused vs unfused: step loss, grad norm and every gradient (HF names, so the
output/embedding weight's gradient included) agree to 1e-5 relative, and the forward-only statistics to
1e-5. Layouts that take different paths through :mod:`megatron_rl.training.head`: TP=2 without sequence
parallelism (the input region's backward all-reduce), TP=2 with it (all-gather / reduce-scatter), tied
embeddings on one stage (the word embedding is the output weight) and over PP=2 (the last stage's tied
copy, whose gradient Megatron all-reduces with the first stage's), plus a reference model's hidden states
for the exact KL. (tests/distributed/test_train_step.py and test_train_invariance.py compare the fused
trainer, the default, with plain autograd over unfused logits too.)
"""

from __future__ import annotations

import pytest
import torch

from multiproc import run_distributed, tiny_hf_checkpoint

import train_helpers  # noqa: F401  (warning filters for the ranks)

RTOL = 1e-5


def _child(untied, tied):
    import train_helpers as th
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.objectives import DenseKLConfig, DVPConfig, EntropyBonusConfig, ObjectiveConfig
    from megatron_rl.training import OptimConfig, TrainConfig

    batch = th.make_batch(batch_size=8, seed=3)
    optim = OptimConfig(lr=1e-3, clip_grad=0.0, use_distributed_optimizer=False)
    kl_obj = ObjectiveConfig(dense_kl=DenseKLConfig(beta=0.1), entropy=EntropyBonusConfig(coef=0.01))
    dvp_obj = ObjectiveConfig(dvp=DVPConfig(enabled=True, min_p=0.05), entropy=EntropyBonusConfig(coef=0.01))
    cases = {  # layout, checkpoint, model overrides, objective, reference model
        "tp2_no_sp_ref_kl": (dict(tp=2), untied, dict(sequence_parallel=False), kl_obj,
                             ModelConfig(hf_path=tied, sequence_parallel=False)),
        "tp2_sp_dvp": (dict(tp=2), untied, {}, dvp_obj, None),
        "tied_dp2": ({}, tied, {}, dvp_obj, None),
        "tied_pp2": (dict(pp=2), tied, {}, kl_obj, ModelConfig(hf_path=untied)),
    }
    out = {}
    for name, (layout, path, overrides, obj, ref) in cases.items():
        for fused in (False, True):
            tc = TrainConfig(micro_batch_size=2, objective=obj, reference_model=ref, fused_head=fused)
            out[name, fused] = th.train_run(path, layout, batch, tc, optim, steps=1, model_overrides=overrides,
                                            forward=True)
    return out


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.timeout(400)
def test_fused_head_equals_logits_path_across_layouts(tmp_path):
    untied = tiny_hf_checkpoint(str(tmp_path / "untied"), "qwen3")
    tied = tiny_hf_checkpoint(str(tmp_path / "tied"), "qwen3", seed=1, tie_word_embeddings=True)
    results = run_distributed(_child, 2, untied, tied, timeout_s=380)
    for rank_out in results:
        for name in {n for n, _ in rank_out}:
            a, b = rank_out[name, True], rank_out[name, False]
            assert not a["skipped"][0] and not b["skipped"][0]
            assert _rel(a["losses"][0], b["losses"][0]) <= RTOL, (name, a["losses"][0], b["losses"][0])
            assert _rel(a["grad_norms"][0], b["grad_norms"][0]) <= RTOL, name
            assert set(a["grads"]) == set(b["grads"])
            for n, g in b["grads"].items():
                err = (a["grads"][n] - g).abs().max().item() / max(g.abs().max().item(), 1e-30)
                assert err <= RTOL, (name, n, err)
            mask = a["forward"]["response_mask"]
            for k, v in b["forward"].items():
                if k != "response_mask" and isinstance(v, torch.Tensor):
                    assert (a["forward"][k].float() - v.float())[mask].abs().max() <= 1e-5, (name, k)
