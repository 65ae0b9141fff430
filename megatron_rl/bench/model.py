"""A random-weight model from an HF config (``bench.model_config=PATH``: a ``config.json`` or a directory with
one), saved once with a word-level tokenizer of the config's vocabulary, so that any shape can be benchmarked
without a download. The directory is reused while the config is unchanged (keyed by its content)."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Dict

# the word-level tokenizer's special tokens, in id order
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")


def read_config(path: str) -> Dict:
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"bench.model_config={path!r}: cannot read an HF config.json ({e}); point it at a "
                         "config.json or a directory holding one") from None


def save_tokenizer(path: str, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = list(SPECIALS) + [f"w{i}" for i in range(len(SPECIALS), vocab)]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    backend.add_special_tokens(list(SPECIALS))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                  unk_token="<unk>")
    tok.save_pretrained(path)


def random_model(config_path: str, root: str, seed: int = 0) -> str:
    """The directory of a random-weight model (safetensors + config + tokenizer) for ``config_path``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = read_config(config_path)
    key = hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:12]
    out = os.path.join(root, f"{raw.get('model_type', 'model')}-{key}")
    if os.path.exists(os.path.join(out, "config.json")) and os.path.exists(os.path.join(out, "tokenizer.json")):
        return out
    cfg = AutoConfig.for_model(**{**raw, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})
    torch.manual_seed(seed)
    dtype = str(raw.get("dtype") or raw.get("torch_dtype") or "float32")
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    tmp = out + ".tmp"
    model.save_pretrained(tmp)
    save_tokenizer(tmp, int(cfg.vocab_size))
    os.replace(tmp, out)
    return out
