"""``megatron-rl export``: trainer checkpoints saved at TP=2, PP=2 (dense Qwen3) and EP=2 (Qwen3-MoE), one
optimizer step after the HF weights, exported to HF directories that ``transformers`` loads with logits
equal to the trainer's own on the same tokens (float32, within 1e-4; the parity test's tolerance), and
with the source directory's tokenizer. The TP=2 vocabulary, padded for TP=2 (vocab_divisor 128 * 2),
exports at TP=1. (The command line runs on the tiny recipe's checkpoint in tests/e2e/test_train_run.py.)"""

from __future__ import annotations

import os

import pytest

from multiproc import run_distributed, tiny_hf_checkpoint

from model_helpers import hf_logits, make_inputs

import train_helpers  # noqa: F401  (warning filters for the ranks)

ATOL = 1e-4
CASES = {"tp2": ("qwen3", dict(tp=2)), "pp2": ("qwen3", dict(pp=2)), "ep2": ("qwen3_moe", dict(ep=2))}


def _train_and_save(paths, root, ids):
    """One optimizer step per layout, a checkpoint, and the trainer's logits of ``ids`` after the step."""
    import torch.distributed as dist

    import train_helpers as th
    from model_helpers import forward_logits
    from megatron_rl import parallel
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.training import OptimConfig, PolicyTrainer, TrainConfig
    from megatron_rl.training import checkpoint as ck

    out = {}
    for name, (_, layout) in CASES.items():
        groups = parallel.init_megatron_parallel(parallel.ParallelLayout(**layout))
        tr = PolicyTrainer(ModelConfig(hf_path=paths[name]), TrainConfig(micro_batch_size=1), groups,
                           OptimConfig(lr=3e-2))
        dp = dist.get_world_size(groups.dp)
        tr.train_step(th.make_batch(batch_size=4, seed=5).split(dp)[groups.dp_rank])
        ck.save_checkpoint(tr, ck.CheckpointConfig(os.path.join(root, name)))
        logits = forward_logits(tr.built, ids)
        if logits is not None:
            out[name] = logits
    return out


def _export(root, out):
    from megatron_rl.export import export_checkpoint

    return {name: export_checkpoint(os.path.join(root, name), os.path.join(out, name)) for name in CASES}


@pytest.mark.timeout(600)
def test_export_tp2_pp2_ep2_checkpoints_to_hf(tmp_path):
    from transformers import AutoTokenizer

    from megatron_rl.data.tiny_tokenizer import make_tiny_tokenizer

    paths = {}
    for name, (model_type, _) in CASES.items():
        paths[name] = tiny_hf_checkpoint(str(tmp_path / "hf" / name), model_type, seed=len(paths))
        make_tiny_tokenizer(paths[name])  # any tokenizer: the export must carry it along
    ids = make_inputs(250, seed=3)
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    ranks = run_distributed(_train_and_save, 2, paths, root, ids, timeout_s=500)
    trained = {k: v for r in ranks for k, v in r.items()}
    assert set(trained) == set(CASES)
    (exported_from,) = run_distributed(_export, 1, root, out, timeout_s=300)
    assert all(p.endswith("iter_0000001") for p in exported_from.values())
    for name in CASES:
        exported = os.path.join(out, name)
        assert os.path.isfile(os.path.join(exported, "model.safetensors"))
        got = hf_logits(exported, ids)
        diff = (got - trained[name]).abs().max().item()
        assert diff <= ATOL, (name, diff)
        # the step moved the weights: the exported model is not the starting one
        assert (hf_logits(paths[name], ids) - got).abs().max().item() > 1e-3, name
        tok = AutoTokenizer.from_pretrained(exported)
        assert tok("3+4=")["input_ids"] == AutoTokenizer.from_pretrained(paths[name])("3+4=")["input_ids"]
