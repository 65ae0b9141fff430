"""Tiny Qwen3 / Qwen3-MoE models built from a config (no download) for the rollout tests."""

from __future__ import annotations

import warnings
from typing import List, Tuple

import torch

warnings.filterwarnings("ignore", message=".*past_key_values.*")

VOCAB = 96
EOS = 3


def tiny_qwen3(seed: int = 0, max_positions: int = 512):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=max_positions, tie_word_embeddings=True, eos_token_id=EOS)
    model = Qwen3ForCausalLM(cfg).eval()
    _sharpen(model, 7.0)  # tied: this also scales the input embeddings
    return model


def tiny_qwen3_moe(seed: int = 0, max_positions: int = 512, dense_layers: Tuple[int, ...] = ()):
    """3 decoder layers, 8 experts top-2; ``dense_layers`` are plain MLPs (``mlp_only_layers``)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_experts=8, num_experts_per_tok=2, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, max_position_embeddings=max_positions,
                         eos_token_id=EOS, tie_word_embeddings=False, mlp_only_layers=list(dense_layers))
    model = Qwen3MoeForCausalLM(cfg).eval()
    _sharpen(model, 25.0)
    return model


def _sharpen(model, output_scale: float) -> None:
    """Randomly initialised tiny models are almost uniform over the vocabulary; scale the output layer
    so distributions have a head and a tail (top-p / min-p then cut something) and routers separate
    experts clearly (no near-ties between the k-th and k+1-th expert)."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(output_scale)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(30.0)


def recompute_logits(model, prompt: List[int], response: List[int]) -> torch.Tensor:
    """``[R, V]`` logits predicting each response token, from one unpadded forward of the full sequence."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    return logits[len(prompt) - 1: len(prompt) + len(response) - 1].float()


def other_weights(model_fn, seed: int) -> List[Tuple[str, torch.Tensor]]:
    """HF-named tensors of a differently seeded model of the same shape (a stand-in for trained weights)."""
    other = model_fn(seed=seed)
    return [(k, v.clone()) for k, v in other.state_dict().items()]
