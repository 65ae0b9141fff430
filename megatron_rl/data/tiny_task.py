"""Assets of the tiny CPU recipe, generated locally and deterministically (no downloads).

:func:`prepare_tiny_arithmetic` writes into one directory:

  tokenizer/      the 64-token character tokenizer (:mod:`megatron_rl.data.tiny_tokenizer`)
  train.jsonl     1024 single-digit additions ``{"prompt": "3+4=", "answer": "7"}``
  eval.jsonl      all 100 distinct additions (exhaustive greedy evaluation)
  student/        a randomly initialised tiny Qwen3 (vocab 64, hidden 64, 2 layers, 4 heads, 2 KV heads,
                  head_dim 16, MLP 128, tied embeddings; ~0.1M parameters) + tokenizer: the policy.
                  ``model="qwen3_moe"``: a tiny Qwen3-MoE instead, the same but for the MLP: 8 experts of
                  width 32 per layer, top-2 (``TINY_QWEN3_MOE``; the MoE recipe examples/tiny_cpu_moe.yaml)
  teacher/        the student after a short supervised fine-tune on the answers (AdamW, 400 steps,
                  a few seconds on a CPU, about a minute for the MoE model whose HF experts run one by
                  one; 100 % greedy accuracy): the imitation warm-up's teacher
  READY.json      the parameters (incl. the model kind) and the teacher's accuracy; present = complete
                  (written last). A directory holds one model kind: asking it for another is an error.

Why a teacher: from a random init the exact-match reward is ~0 for every sample, so every GRPO group
has equal rewards and no gradient. A few steps of the dense imitation gradient (reverse KL to the
teacher on the student's own samples) lift the reward off zero; GRPO then takes it the rest of the way.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Dict, List

import torch
import transformers

from megatron_rl.data.arithmetic import all_problems, generate_problems, write_arithmetic_dataset, write_jsonl
from megatron_rl.data.tiny_tokenizer import make_tiny_tokenizer

logger = logging.getLogger(__name__)

TINY_QWEN3 = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=128, tie_word_embeddings=True, max_position_embeddings=64,
                  rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# The MoE variant: the dense model's attention and embeddings; each layer's MLP is 8 experts of width 32 with
# top-2 routing (renormalised weights, as Qwen3-MoE): 2 x 32 active MLP width per token (the dense model's 128
# halved), while routing has real choices to replay; 8 experts split evenly over EP=2 or 4
TINY_QWEN3_MOE = dict(TINY_QWEN3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
# The DeepSeek-V3-style variant (examples/tiny_cpu_deepseek.yaml): MLA (q LoRA 32, KV latent 32, 4 heads of
# 16 + 16 rotary dims, values 16), layer 0 a dense MLP, layer 1 MoE: 8 routed experts of width 32 in 4 groups
# (group-limited: a token's top-2 experts come from its best group of 4), sigmoid scores with a
# score bias, routed weights renormalised then scaled by 2.5, plus a shared expert of width 32
TINY_DEEPSEEK_V3 = dict(
    {k: v for k, v in TINY_QWEN3.items() if k not in ("head_dim", "rope_theta")},
    num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    moe_intermediate_size=32, n_group=4, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, num_nextn_predict_layers=0)
# The GLM-4.5-style variant (examples/tiny_cpu_glm.yaml): the dense model's GQA attention with q/k/v biases, q/k
# norms and RoPE on half of each head; layer 0 dense, layer 1 DeepSeek-V3's router (8 experts of width 32 in 2
# groups, top-1 group, top-2 experts, sigmoid scores + score bias, weights renormalised, scaled by 2.5) + a shared
# expert of width 32
TINY_GLM4_MOE = dict(
    {k: v for k, v in TINY_QWEN3.items() if k != "rope_theta"},
    first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
    n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    num_nextn_predict_layers=0)
MODELS = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM", TINY_QWEN3),
          "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", TINY_QWEN3_MOE),
          "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", TINY_DEEPSEEK_V3),
          "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", TINY_GLM4_MOE)}
_VERSION = 1  # bump when the assets change, so stale directories are rebuilt


def prepare_tiny_arithmetic(directory: str, *, seed: int = 0, model: str = "qwen3", num_train: int = 1024,
                            sft_steps: int = 400, sft_lr: float = 3e-3, sft_batch: int = 32) -> Dict[str, str]:
    """Build the assets under ``directory`` unless a complete set with these parameters is there.
    ``model``: ``qwen3`` (dense), ``qwen3_moe``, ``deepseek_v3`` or ``glm4_moe``; a directory already holding the other kind raises
    ValueError (dense and MoE assets never share a directory)."""
    if model not in MODELS:
        raise ValueError(f"prepare.model={model!r}: expected one of {sorted(MODELS)}")
    params = dict(version=_VERSION, seed=seed, num_train=num_train, sft_steps=sft_steps, sft_lr=sft_lr,
                  sft_batch=sft_batch, model=MODELS[model][2])
    if model != "qwen3":  # the dense READY.json predates the field: absent means qwen3 (dense assets unchanged)
        params["model_kind"] = model
    paths = {name: os.path.join(directory, name) for name in ("tokenizer", "train.jsonl", "eval.jsonl", "student",
                                                               "teacher")}
    ready = os.path.join(directory, "READY.json")
    if os.path.isfile(ready):
        with open(ready) as f:
            held = json.load(f).get("params") or {}
        if held == params:
            return paths
        held_kind = held.get("model_kind", "qwen3")
        if held_kind != model:
            raise ValueError(f"prepare.dir={directory!r} holds tiny {held_kind} assets but prepare.model={model!r}; "
                             f"use another prepare.dir for {model} (e.g. runs/tiny_assets_moe) or delete {directory}")
    logger.info("preparing the tiny arithmetic assets (%s) in %s", model, directory)
    os.makedirs(directory, exist_ok=True)
    if os.path.exists(ready):
        os.remove(ready)

    tok = make_tiny_tokenizer(paths["tokenizer"])
    write_arithmetic_dataset(paths["train.jsonl"], num_problems=num_train, seed=seed)
    write_jsonl(paths["eval.jsonl"], all_problems())
    student = _student(seed, model)
    _save(student, tok, paths["student"])
    teacher = _student(seed, model)
    accuracy = _supervised_fine_tune(teacher, tok, seed, sft_steps, sft_lr, sft_batch)
    _save(teacher, tok, paths["teacher"])
    with open(ready + ".tmp", "w") as f:
        json.dump({"params": params, "teacher_greedy_accuracy": accuracy}, f, indent=1)
    os.replace(ready + ".tmp", ready)
    logger.info("tiny %s assets ready (teacher greedy accuracy %.2f)", model, accuracy)
    return paths


def _student(seed: int, model: str = "qwen3"):
    config_cls, model_cls, fields = MODELS[model]
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**fields)).float()


def _save(model, tok, path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    model.save_pretrained(path)  # safetensors
    tok.save_pretrained(path)


def _encode(tok, rows: List[Dict[str, str]]):
    """``[N, L]`` ids of ``<bos>prompt answer<eos>`` and the mask of the answer tokens (incl. EOS)."""
    seqs, masks = [], []
    for r in rows:
        prompt = tok(r["prompt"])["input_ids"]
        answer = tok(r["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
    width = max(map(len, seqs))
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
    mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.bool)
    return ids, mask


def _supervised_fine_tune(model, tok, seed: int, steps: int, lr: float, batch: int) -> float:
    """Cross-entropy on the answer tokens of the train problems; returns the greedy accuracy on all 100."""
    ids, mask = _encode(tok, generate_problems(4096, seed=seed + 1))
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        rows = torch.randint(0, len(ids), (batch,), generator=g)
        x, m = ids[rows], mask[rows]
        logits = model(input_ids=x).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits[m[:, 1:]], x[:, 1:][m[:, 1:]])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return greedy_accuracy(model, tok)


@__import__("torch").no_grad()
def greedy_accuracy(model, tok) -> float:
    """Exact-match accuracy of greedy answers over all 100 problems (teacher-forced argmax decoding)."""
    rows = all_problems()
    correct = 0
    for r in rows:
        ids = torch.tensor([tok(r["prompt"])["input_ids"]])
        for _ in range(4):
            nxt = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            if int(nxt) == tok.eos_token_id:
                break
        text = tok.decode(ids[0, len(tok(r["prompt"])["input_ids"]):], skip_special_tokens=True)
        correct += text.strip() == r["answer"]
    return correct / len(rows)
