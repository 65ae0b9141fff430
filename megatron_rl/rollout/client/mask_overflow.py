"""What the client does when SGLang 0.5.23 refuses a ``/generate`` batch over ``--sampling-mask-max-tokens``.

With ``return_sampling_mask`` ("processed" log-probs) SGLang aborts a request whose sampling support (the kept
tokens, ties at the top-k cutoff included) exceeds the server's cap, and answers HTTP 400 for the whole batch --
all ``n`` samples of the group (``managers/scheduler_components/batch_result_processor.py:1332-1341``,
``managers/tokenizer_manager.py:1891-1921, 2197-2203``). Ties depend on the sampled path, so the client sends the
group again with fresh seeds (derived from the request's seed: a seeded run stays reproducible), at most
``retries`` times; if it still overflows, the group comes back as ``n`` aborted, empty samples carrying SGLang's
message -- loss-masked like every abort, counted in ``rollout/sampling_mask_overflow`` -- and the run goes on.
Every refusal is logged and counted in ``SGLangClient.mask_overflows``.
"""

from __future__ import annotations

from typing import List

from megatron_rl.rollout.client.protocol import GenerateRequest, Sample, derive_seed
from megatron_rl.rollout.client.errors import RequestRejected

# the start of SGLang's message (and of the embedded double's)
SAMPLING_MASK_OVERFLOW = "Sampling support exceeds --sampling-mask-max-tokens="
_RETRY_SALT = 0x5A3D_0F10  # retry seeds live apart from the children's derive_seed(base, j)


def is_overflow(error: BaseException) -> bool:
    return isinstance(error, RequestRejected) and SAMPLING_MASK_OVERFLOW in str(error)


def retry_seed(base: int, attempt: int) -> int:
    """The base seed of retry ``attempt`` (>= 1) of a group whose base seed was ``base``."""
    return derive_seed(base, _RETRY_SALT + attempt)


def aborted_group(children: List[GenerateRequest], message: str, logprob_mode: str) -> List[Sample]:
    return [Sample(list(c.prompt_ids), [], [], "abort", rid=c.rid, sample_index=j, abort_message=message,
                   logprob_mode=logprob_mode, sampling_logprobs=[])
            for j, c in enumerate(children)]


def overflowed(sample: Sample) -> bool:
    return sample.finish_reason == "abort" and SAMPLING_MASK_OVERFLOW in (sample.abort_message or "")
