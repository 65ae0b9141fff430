"""The rollout engine protocol: what the trainer asks a rollout engine for and what it gets back.

Every engine (the embedded ``transformers`` engine, an SGLang server behind HTTP, a balancer over
several) speaks these typed records, so the driver never sees an engine-specific dict.

Which distribution the returned log-probs are under
---------------------------------------------------
For a response token ``y_t`` sampled at context ``c_t`` with logits ``l`` (vocabulary ``V``):

* ``"raw"`` (the default, SGLang's default): ``log softmax(l / T)[y_t]`` -- temperature applied,
  **no** renormalisation over the top-k / top-p / min-p kept set, although the token was *sampled*
  from that renormalised set. For greedy requests (``temperature == 0``) it is ``log softmax(l)[y_t]``
  (temperature 1), again as SGLang does.
* ``"processed"``: ``log softmax(l / T)[y_t] - log Z_K`` with ``Z_K`` the probability mass of the kept
  set ``K`` -- the log-prob under the distribution the token was actually drawn from (math_spec
  §(b.2) ``log mu_K``). Greedy requests get ``0.0`` (top-k = 1).

Both agree exactly when no filter is active (``top_k=-1, top_p=1, min_p=0``). With a filter, a trainer
that recomputes full-vocabulary log-probs must compare against ``"raw"``; a trainer that prunes the
same kept set (DVP, math_spec §(b.2)) must compare against ``"processed"``.

What SGLang 0.5.23 returns (read from its released source, ``srt/layers/sampler.py``): the sampler divides the
logits by the temperature, takes ``softmax``, filters a copy of ``probs`` for top-k/top-p/min-p and returns
``log(probs)`` of the sampled token in ``output_token_logprobs`` -- always ``"raw"``. Greedy requests
(temperature 0 becomes temperature 1 with top_k 1) get ``log_softmax(logits)``. The ``"processed"`` value
comes only when the request sets ``return_sampling_mask``: ``output_token_sampling_logprobs`` holds
``log(p_sampled / mass of the support)`` per token (``SamplingLogprobsMode`` "selected"), beside
``output_token_sampling_mask`` (the support's token ids). SGLang aborts a request whose support exceeds
``--sampling-mask-max-tokens`` (default 4096), so pair ``"processed"`` with a top-k below that.

Filter semantics (SGLang's torch sampler, "joint" order): on the temperature-scaled probabilities
sorted in descending order, keep rank ``< top_k``; keep a token if the mass strictly before it is
``<= top_p``; keep a token if its probability is ``>= min_p * max_prob``. ``K`` is the intersection,
always containing the argmax. (SGLang's flashinfer backend does the same for top-k/top-p, but when
``min_p > 0`` it applies top-p to the top-k-*renormalised* probabilities -- sequential, not joint; its
kept set can then differ slightly from ours. The flashinfer sampler also refuses ``sampling_seed``.)
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_rl.rollout.client.weight_versions import WeightVersionSpan, token_versions
from megatron_rl.weights.receiver import WeightReceiver

LOGPROB_MODES = ("raw", "processed")
FINISH_REASONS = ("stop", "length", "abort")

class SamplingParamsError(ValueError):
    """An invalid sampling parameter; ``field`` names it (the HTTP server reports it back)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def _bad(field_name: str, value: Any, expected: str, fix: str) -> SamplingParamsError:
    return SamplingParamsError(f"SamplingParams.{field_name}={value!r} is invalid: expected {expected}; {fix}",
                               field_name)


@dataclass(frozen=True)
class SamplingParams:
    """SGLang-compatible sampling parameters (same names and defaults as SGLang's ``sampling_params``).

    ``temperature == 0`` means greedy. ``top_k == -1`` disables top-k. ``seed`` (SGLang:
    ``sampling_seed``) makes the request reproducible independently of how it is batched; sample ``j``
    of ``n`` uses a seed derived from ``(seed, j)``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop_token_ids: Tuple[int, ...] = ()
    n: int = 1
    seed: Optional[int] = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Frozen dataclass: normalise stop ids to a tuple through object.__setattr__.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise _bad("temperature", t, "a finite number >= 0", "use 0 for greedy decoding, 1.0 for plain sampling")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise _bad("top_p", p, "a number in (0, 1]", "use 1.0 to disable nucleus filtering")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or not (k == -1 or k >= 1):
            raise _bad("top_k", k, "-1 (disabled) or an integer >= 1", "use -1 to disable top-k filtering")
        mp = self.min_p
        if isinstance(mp, bool) or not isinstance(mp, (int, float)) or not (0.0 <= mp <= 1.0):
            raise _bad("min_p", mp, "a number in [0, 1]", "use 0.0 to disable min-p filtering")
        m = self.max_new_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise _bad("max_new_tokens", m, "an integer >= 1", "ask for at least one new token")
        for s in self.stop_token_ids:
            if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                raise _bad("stop_token_ids", self.stop_token_ids, "a list of token ids (integers >= 0)",
                           f"remove {s!r}")
        n = self.n
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise _bad("n", n, "an integer >= 1", "use n=1 for one sample per prompt")
        sd = self.seed
        if sd is not None and (isinstance(sd, bool) or not isinstance(sd, int) or not (0 <= sd < 2**63)):
            raise _bad("seed", sd, "None or an integer in [0, 2**63)", "pass a non-negative int or None")
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", self.ignore_eos, "a bool", "pass true or false")

    @property
    def filtered(self) -> bool:
        """Whether top-k / top-p / min-p cut the distribution ("raw" and "processed" log-probs then differ)."""
        return self.top_k != -1 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def greedy(self) -> bool:
        # SGLang rewrites temperature 0 as (temperature 1, top_k 1). It also takes its greedy
        # log-prob path (no temperature) when *every* request of a batch has top_k=1 -- a batch-dependent
        # quirk we do not copy: here only temperature == 0 is greedy.
        return self.temperature == 0

    def to_sglang(self) -> Dict[str, Any]:
        """The ``sampling_params`` JSON object SGLang's ``/generate`` takes."""
        out: Dict[str, Any] = dict(
            temperature=float(self.temperature), top_p=float(self.top_p), top_k=int(self.top_k),
            min_p=float(self.min_p), max_new_tokens=int(self.max_new_tokens), n=int(self.n),
            ignore_eos=self.ignore_eos,
        )
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            out["sampling_seed"] = int(self.seed)
        return out


@dataclass(frozen=True)
class GenerateRequest:
    """One prompt (token ids) to sample ``sampling.n`` responses for.

    ``return_top_logprobs``: also return the ``k`` most likely tokens per position (0 = none), under the
    same convention as the sampled-token log-probs. ``return_routed_experts``: MoE engines return the
    expert ids the router chose (see ``Sample.routed_experts``). ``return_sampling_logprobs``: also return
    each token's ``"processed"`` log-prob in ``Sample.sampling_logprobs`` (SGLang's
    ``return_sampling_mask``). ``rid`` names the request for ``abort``; engines make one up when it is None.
    """

    prompt_ids: Tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_top_logprobs: int = 0
    return_routed_experts: bool = False
    rid: Optional[str] = None
    return_sampling_logprobs: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))
        if not self.prompt_ids:
            raise ValueError("GenerateRequest.prompt_ids is empty: a prompt needs at least one token id")
        for t in self.prompt_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"GenerateRequest.prompt_ids contains {t!r}: expected token ids (integers >= 0)")
        k = self.return_top_logprobs
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"GenerateRequest.return_top_logprobs={k!r}: expected an integer >= 0 (0 = none)")
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"GenerateRequest.sampling must be a SamplingParams, got {type(self.sampling).__name__}")


@dataclass
class Sample:
    """One generated response.

    Shapes (``R`` = ``len(response_ids)``, ``P`` = ``len(prompt_ids)``, ``L`` = number of sparse-MoE
    layers in module order, ``topk`` = experts per token, ``k`` = ``return_top_logprobs``):

    * ``logprobs``: ``[R]`` log-prob of each sampled token, convention ``logprob_mode`` (module doc).
    * ``top_logprob_ids`` / ``top_logprob_values``: ``[R, k]`` int64 / float32, or None.
    * ``routed_experts``: ``[R, L, topk]`` int32; row ``t`` is the routing computed at the position that
      holds response token ``t`` (the token as *input*). ``prompt_routed_experts``: ``[P, L, topk]``,
      same convention for the prompt. A row of ``-1`` marks routing that was never computed: SGLang never
      feeds the last response token back, so over HTTP its row is ``-1``. Its routing cannot influence
      any response log-prob (causal attention), so a replay consumer may route that row freely.
    * ``sampling_logprobs``: ``[R]`` ``"processed"`` log-probs when the request asked for them, else None.
    * ``weight_version``: the engine's version when the sample finished (weights updated during an
      in-place pause make one response span two versions).
    * ``weight_versions``: the contiguous spans of response tokens each version produced (SGLang 0.5.23's
      ``meta_info.weight_versions``, ``weight_versions.py``); None when the engine did not report them.
      :meth:`token_versions` gives the per-token integer policy versions.
    * ``finish_reason``: ``"stop"`` (``matched_stop`` = the stop/EOS token, which is the last response
      token), ``"length"`` (``max_new_tokens`` or the context length reached), ``"abort"``.
    """

    prompt_ids: List[int]
    response_ids: List[int]
    logprobs: List[float]
    finish_reason: str
    matched_stop: Optional[int] = None
    top_logprob_ids: Optional[torch.Tensor] = None
    top_logprob_values: Optional[torch.Tensor] = None
    routed_experts: Optional[torch.Tensor] = None
    prompt_routed_experts: Optional[torch.Tensor] = None
    weight_version: str = "default"
    logprob_mode: str = "raw"
    rid: Optional[str] = None
    sample_index: int = 0
    sampling_logprobs: Optional[List[float]] = None
    abort_message: Optional[str] = None  # why an "abort" finish happened, when the engine said
    weight_versions: Optional[List[WeightVersionSpan]] = None

    def token_versions(self) -> List[int]:
        """``[R]`` the policy version that produced each response token (``weight_version`` for all of them
        when the engine reported no spans)."""
        return token_versions(self.weight_versions, self.weight_version, len(self.response_ids))

    def __post_init__(self) -> None:
        assert self.finish_reason in FINISH_REASONS, self.finish_reason
        assert len(self.logprobs) == len(self.response_ids), (len(self.logprobs), len(self.response_ids))
        if self.routed_experts is not None:
            assert self.routed_experts.dim() == 3 and self.routed_experts.shape[0] == len(self.response_ids), (
                tuple(self.routed_experts.shape), len(self.response_ids))


@dataclass(frozen=True)
class ExpertLayout:
    """Which decoder layers are sparse-MoE (``moe_layers[i]``) and how many experts each token picks.

    SGLang's ``routed_experts`` has one row per decoder layer (``num_hidden_layers``; zeros for dense
    layers); ``Sample.routed_experts`` keeps only the MoE layers, in layer order."""

    moe_layers: Tuple[bool, ...]
    topk: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe_layers", tuple(bool(m) for m in self.moe_layers))
        if not any(self.moe_layers) or self.topk < 1:
            raise ValueError(f"ExpertLayout(moe_layers={self.moe_layers}, topk={self.topk}): expected at least one "
                             "MoE layer and topk >= 1")

    @property
    def num_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def moe_indices(self) -> List[int]:
        return [i for i, m in enumerate(self.moe_layers) if m]


@dataclass
class EngineHealth:
    healthy: bool
    weight_version: str
    memory_released: bool = False
    paused: bool = False
    detail: str = ""


class RolloutEngine(WeightReceiver):
    """What the driver needs from a rollout engine (and, as a WeightReceiver, what a weight sync needs).
    Implementations: ``EmbeddedEngine`` (in-process ``transformers``), ``RemoteEngine`` (SGLang or the
    embedded server over HTTP)."""

    @abc.abstractmethod
    def generate(self, requests: Sequence[GenerateRequest]) -> List[Sample]:
        """Sample every request; returns ``sum(r.sampling.n)`` samples, request-major (all ``n`` samples
        of request 0, then request 1, ...), ``sample_index`` numbering the ``n`` samples."""

    @abc.abstractmethod
    def release_memory(self) -> None:
        """Free accelerator memory (weights, KV cache) for the colocated trainer; ``generate`` refuses
        until ``resume_memory``."""

    @abc.abstractmethod
    def resume_memory(self) -> None:
        """Undo ``release_memory``."""

    @abc.abstractmethod
    def health(self) -> EngineHealth:
        """Cheap liveness check."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release every resource; the engine is unusable afterwards."""


_MASK64 = (1 << 64) - 1


def derive_seed(seed: int, sample_index: int) -> int:
    """Seed of sample ``sample_index`` of a request seeded ``seed`` (splitmix64 of the pair), so that
    requests seeded 1 and 2 with ``n=2`` do not share streams as ``seed + index`` would."""
    z = (seed * 0x9E3779B97F4A7C15 + (sample_index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)
