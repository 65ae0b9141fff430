"""Trainer checkpoint -> HF directory: ``megatron-rl export CHECKPOINT_DIR OUT_DIR [--model HF_DIR]``.

Any checkpoint :mod:`megatron_rl.training.checkpoint` wrote (any TP / PP / EP layout, dense or MoE) is
loaded — model weights only; dist-checkpointing reshards them — into the model built at the export's
own layout (TP=PP=EP=1 in one process by default: the whole model in host memory; under ``torchrun``
with ``--tp/--pp/--ep`` it is collective over the launched ranks), then written by
:func:`megatron_rl.models.weights.save_hf_checkpoint`: safetensors shards (+ index), ``config.json``,
generation config and tokenizer files of the model's HF directory, which ``transformers`` loads.

Which model: the checkpoint records its ``ModelConfig`` (checkpoints written before that: the run's
``config.yaml`` beside the checkpoint root); ``--model`` overrides its HF directory (config and
tokenizer source). The padded vocabulary is read from the checkpoint itself, so a checkpoint saved at
TP=2 (vocabulary padded to a multiple of ``vocab_divisor * 2``) exports at TP=1.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Optional

import torch.distributed as dist
import yaml
from megatron.core import dist_checkpointing

from megatron_rl import config_io, parallel
from megatron_rl.models.build import build_model
from megatron_rl.models.config import ModelConfig
from megatron_rl.models.weights import save_hf_checkpoint
from megatron_rl.parallel import ParallelLayout
from megatron_rl.training.checkpoint import iter_name, latest_checkpoint

if TYPE_CHECKING:  # torch and Megatron load when an export runs, not with the command line
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.parallel import ParallelLayout

_EMBEDDING = "embedding.word_embeddings.weight"


def resolve_checkpoint(path: str, step: Optional[int] = None) -> str:
    """An ``iter_*`` directory: ``path`` itself, or the latest (or ``step``'s) under a checkpoint root."""
    if step is not None:
        found = os.path.join(path, iter_name(step))
    elif os.path.isfile(os.path.join(path, "metadata.json")):
        found = path
    else:
        found = latest_checkpoint(path)
    if found is None or not os.path.isfile(os.path.join(found, "metadata.json")):
        raise FileNotFoundError(f"{path}: no trainer checkpoint there (an iter_* directory, or a checkpoint root "
                                "with a 'latest' pointer)")
    return found


def _run_config_model(ckpt: str) -> Optional["ModelConfig"]:
    """The ``model`` section of the run's config.yaml (``<run>/checkpoints/iter_N`` -> ``<run>/config.yaml``)."""
    for up in (2, 3):
        path = os.path.join(os.path.abspath(os.path.join(ckpt, *[".."] * (up - 1))), "config.yaml")
        if os.path.isfile(path):
            with open(path) as f:
                section = (yaml.safe_load(f) or {}).get("model")
            return config_io.build(ModelConfig, section, "model") if section else None
    return None


def checkpoint_model_config(ckpt: str, model_path: Optional[str] = None) -> "ModelConfig":
    """The ModelConfig a checkpoint was trained with (``model_path`` replaces its HF directory)."""
    saved = dist_checkpointing.load_common_state_dict(ckpt)["trainer"].get("model")
    cfg = ModelConfig(**saved) if saved else _run_config_model(ckpt)
    if cfg is None:
        if model_path is None:
            raise ValueError(f"{ckpt} does not record its model and no config.yaml is beside it: pass --model "
                             "HF_DIR (the HF directory the run started from: config.json and tokenizer)")
        cfg = ModelConfig(hf_path=model_path)
    if model_path is not None:
        cfg = dataclasses.replace(cfg, hf_path=model_path)
    if not os.path.isdir(cfg.hf_path):
        raise FileNotFoundError(f"the checkpoint's model directory {cfg.hf_path!r} (its config.json and tokenizer) "
                                "is not there; pass --model HF_DIR")
    return cfg


def export_checkpoint(checkpoint: str, out_dir: str, *, model_path: Optional[str] = None,
                      tokenizer: Optional[str] = None, step: Optional[int] = None,
                      layout: Optional["ParallelLayout"] = None) -> str:
    """Write ``checkpoint``'s weights as an HF directory ``out_dir``; returns the checkpoint exported.

    Collective over the initialised default process group (``layout`` must fit its size).
    """
    layout = layout or ParallelLayout()
    ckpt = resolve_checkpoint(checkpoint, step)
    cfg = checkpoint_model_config(ckpt, model_path)
    padded = dist_checkpointing.load_tensors_metadata(ckpt)[_EMBEDDING].global_shape[0]
    if padded % layout.tp:
        raise ValueError(f"{ckpt}: the padded vocabulary ({padded}) does not split over tp={layout.tp}")
    cfg = dataclasses.replace(cfg, vocab_divisor=padded // layout.tp,  # the saved padding, whatever layout saved it
                              transformer_overrides={**cfg.transformer_overrides, "perform_initialization": False})
    groups = parallel.init_megatron_parallel(layout)
    built = build_model(cfg, groups, load_weights=False)
    loaded = dist_checkpointing.load({"model": built.module.sharded_state_dict()}, ckpt)
    built.module.load_state_dict(loaded["model"])
    save_hf_checkpoint(built, out_dir, src_dir=cfg.hf_path)

    if tokenizer is not None and dist.get_rank() == 0:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer).save_pretrained(out_dir)
    return ckpt


