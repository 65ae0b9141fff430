"""A 64-token character-level tokenizer for the tiny CPU recipe, built locally (no downloads).

Every character is one token, so arithmetic strings tokenise predictably ("3+4=" -> 4 tokens) and a
~1M-parameter model only has to learn a 64-way output. It is an ordinary HF fast tokenizer
(``tokenizers`` WordLevel model, saved with ``save_pretrained``), so ``AutoTokenizer.from_pretrained``
loads it and the rest of the stack treats it like any real tokenizer.

Ids (stable; the tiny model's ``vocab_size`` must be :data:`TINY_VOCAB_SIZE` = 64):

====  ==================  ===============================================================
id    token               role
====  ==================  ===============================================================
0     ``<pad>``           pad_token
1     ``<bos>``           bos_token; ``tokenizer(text)`` prepends it
2     ``<eos>``           eos_token; the model ends its answer with it
3     ``<unk>``           unk_token (any character outside the table below)
4-6   ``<|system|>``,     chat role markers (special: dropped by ``skip_special_tokens``)
      ``<|user|>``,
      ``<|assistant|>``
7-16  ``0``-``9``
17-28 ``+ - * / = ( ) . , ?`` newline, space
29-54 ``a``-``z``
55-63 ``<|reserved_0|>``..  unused specials that pad the vocabulary to 64, so any id the model
      ``<|reserved_8|>``  can emit decodes (and 64 divides evenly for tensor parallelism)
====  ==================  ===============================================================

Chat template: ``<bos><|system|>S<|user|>U<|assistant|>A<eos>...`` and, with
``add_generation_prompt=True``, a trailing ``<|assistant|>``.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import PreTrainedTokenizerFast

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SYSTEM_ID, USER_ID, ASSISTANT_ID = 4, 5, 6
TINY_VOCAB_SIZE = 64

_SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
_CHARS = list("0123456789") + list("+-*/=().,?\n ") + list("abcdefghijklmnopqrstuvwxyz")
_RESERVED = [f"<|reserved_{i}|>" for i in range(TINY_VOCAB_SIZE - len(_SPECIAL) - len(_CHARS))]

# Roles map onto the three marker tokens; any other role is an error rather than a string of <unk>s.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('tiny tokenizer chat template: unknown role ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tiny_tokenizer() -> Any:
    """The tokenizer in memory (a ``transformers`` fast tokenizer); see the module docstring for ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens = _SPECIAL + _CHARS + _RESERVED
    assert len(tokens) == TINY_VOCAB_SIZE and len(set(tokens)) == TINY_VOCAB_SIZE
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per char
    backend.decoder = decoders.Fuse()  # join characters back without the default space separator
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)])
    # Registered as special in the backend so that the text "<|user|>" is one token (not 8 characters)
    # and `decode(..., skip_special_tokens=True)` drops them, whatever the transformers version.
    backend.add_special_tokens(_SPECIAL + _RESERVED)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                  pad_token="<pad>", unk_token="<unk>", chat_template=CHAT_TEMPLATE,
                                  model_max_length=4096)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (PAD_ID, BOS_ID, EOS_ID, UNK_ID)
    return tok


def make_tiny_tokenizer(directory: str | os.PathLike) -> Any:
    """Build the tokenizer, ``save_pretrained`` it into ``directory`` (created if needed), return it.

    ``AutoTokenizer.from_pretrained(directory)`` loads it back.
    """
    tok = build_tiny_tokenizer()
    os.makedirs(directory, exist_ok=True)
    tok.save_pretrained(os.fspath(directory))
    return tok
