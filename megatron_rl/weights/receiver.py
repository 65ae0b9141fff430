"""WeightReceiver: what an engine implements to take part in a weight sync (``weights/sync.py``).

The sync asks the engine, never its type: ``weights_dtype`` (the dtype the pieces are cast to) and
``receives_in_place`` (whether ``weight_update(version)`` hands out a target that takes each trainer rank's
pieces in place, so the sender need not assemble full tensors). ``RolloutEngine`` is a WeightReceiver;
a duck-typed one (any object with ``update_weights``, e.g. a colocated transport or a test's delegate) gets
the defaults through :func:`weights_dtype` / :func:`receives_in_place`.
"""

from __future__ import annotations

import abc
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import torch

# A bucket of named HF tensors, e.g. ``[("model.layers.0.self_attn.q_proj.weight", tensor), ...]``.
NamedTensorBucket = Iterable[Tuple[str, torch.Tensor]]


class WeightReceiver(abc.ABC):
    """The weight-sync side of an engine."""

    @abc.abstractmethod
    def update_weights(self, named_tensor_buckets: Iterable[NamedTensorBucket], version: Any) -> None:
        """Load HF-named tensors, bucket by bucket (a bucket is an iterable of ``(hf_name, tensor)``),
        then set the weight version (``str(version)``) reported in every later ``Sample``."""

    def prompt_logprobs(self, token_ids: Sequence[int]) -> List[torch.Tensor]:
        """Teacher-forced log-probs of a given sequence, one ``[L - 1]`` float32 tensor per engine replica
        (``EmbeddedEngine``: one; ``RemoteEngine``: one per server, in server order): entry ``t`` is
        ``log softmax(logits_t)[token_ids[t + 1]]`` at temperature 1 over the full vocabulary -- SGLang's
        ``input_token_logprobs`` with ``logprob_start_len=0`` minus its empty first entry. The weight-sync
        check compares these with the trainer's (``weights/probe.py``); per replica, because one
        server that missed an update must not hide behind the others."""
        raise NotImplementedError(f"{type(self).__name__} cannot score a given token sequence; implement "
                                  "prompt_logprobs() or turn the weight-sync check off (WeightSyncConfig.check)")

    def weights_dtype(self) -> Optional[torch.dtype]:
        """The dtype the engine holds its weights in, when it knows it (SGLang does not report it: None, and
        ``WeightSyncConfig.engine_dtype`` or the trainer's params dtype decides)."""
        return None

    def receives_in_place(self) -> bool:
        """True when ``weight_update(version)`` is a context manager yielding a target that takes each trainer
        rank's pieces in place (an in-process engine); False: the sender streams full HF tensors."""
        return False


def weights_dtype(engine: Any) -> Optional[torch.dtype]:
    """``engine.weights_dtype()``; None for a duck-typed engine (any object with ``update_weights``) without it."""
    ask = getattr(engine, "weights_dtype", None)
    return ask() if ask is not None else None


def receives_in_place(engine: Any) -> bool:
    """``engine.receives_in_place()``; False for a duck-typed engine without it."""
    ask = getattr(engine, "receives_in_place", None)
    return bool(ask()) if ask is not None else False
