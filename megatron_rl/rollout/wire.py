"""SGLang's native HTTP JSON <-> our typed records, shared by the embedded server and the HTTP client
so both ends encode the same way.

``/generate`` (SGLang 0.5.x field names): request ``input_ids`` (one prompt or a list),
``sampling_params`` (one object or one per prompt), ``return_logprob``, ``top_logprobs_num``,
``logprob_start_len`` (``>= 0``: prompt log-probs ``input_token_logprobs`` from that position, first entry
``None``), ``return_routed_experts``, ``routed_experts_start_len``, ``rid``. Response item:
``{"text", "output_ids", "meta_info": {"id", "finish_reason": {"type": "stop"|"length"|"abort", ...},
"prompt_tokens", "completion_tokens", "weight_version", "output_token_logprobs": [[logprob, id, null]],
"output_top_logprobs": [[[logprob, id, null], ...]], "routed_experts": base64 int32}}``. A single prompt
with ``n > 1`` answers a list of ``n`` items; a batch answers one flat list, prompt-major.

``routed_experts`` follows SGLang: rows for the whole sequence except the last token
(``prompt + completion - 1`` rows, from ``routed_experts_start_len``), each ``[layers, topk]``.

Weight buckets for ``/update_weights_from_tensor`` (the embedded server's format, *not* SGLang's:
SGLang pickles tensors with its ``MultiprocessingSerializer`` (CUDA IPC handles, same host, needs
``sglang`` importable)). We send ``load_format="safetensors"`` with ``serialized_named_tensors`` = a
list of base64-encoded safetensors files, one bucket each; or ``load_format="safetensors_file"`` with
paths of safetensors files the server can read (what ``SGLangClient`` sends a server on its own machine:
files in /dev/shm, removed once the server has answered).
"""

from __future__ import annotations

import base64
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_rl.rollout.protocol import GenerateRequest, Sample, SamplingParams, SamplingParamsError


class BadRequest(ValueError):
    """A malformed HTTP request; ``field`` names the offending JSON field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


# sampling_params keys SGLang knows that the embedded engine does not implement: accepted only at
# their no-op value so a client's defaults pass, refused (400) otherwise.
_NOOP_SAMPLING_KEYS = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "min_new_tokens": (0,), "stop": (None, [], ""), "regex": (None,), "json_schema": (None,), "ebnf": (None,),
    "structural_tag": (None,), "logit_bias": (None, {}), "custom_params": (None,),
}
_FREE_SAMPLING_KEYS = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}
_SAMPLING_KEYS = {"temperature", "top_p", "top_k", "min_p", "max_new_tokens", "stop_token_ids", "n",
                  "ignore_eos"}


def parse_sampling_params(obj: Any, where: str) -> SamplingParams:
    if not isinstance(obj, dict):
        raise BadRequest(where, f"expected a JSON object, got {type(obj).__name__}")
    kwargs: Dict[str, Any] = {}
    for key, value in obj.items():
        if key in _SAMPLING_KEYS:
            kwargs[key] = value
        elif key in ("sampling_seed", "seed"):
            kwargs["seed"] = value
        elif key in _NOOP_SAMPLING_KEYS:
            if value not in _NOOP_SAMPLING_KEYS[key]:
                raise BadRequest(f"{where}.{key}", f"{value!r} is not supported by the embedded engine "
                                 f"(only {_NOOP_SAMPLING_KEYS[key][0]!r})")
        elif key not in _FREE_SAMPLING_KEYS:
            raise BadRequest(f"{where}.{key}", "unknown sampling parameter")
    if kwargs.get("top_k") is None and "top_k" in kwargs:
        kwargs["top_k"] = -1
    if isinstance(kwargs.get("stop_token_ids"), list) or kwargs.get("stop_token_ids") is None:
        kwargs["stop_token_ids"] = tuple(kwargs.get("stop_token_ids") or ())
    else:
        raise BadRequest(f"{where}.stop_token_ids", "expected a list of token ids")
    try:
        return SamplingParams(**kwargs)
    except SamplingParamsError as e:
        raise BadRequest(f"{where}.{'sampling_seed' if e.field == 'seed' else e.field}", str(e)) from None


def _is_int_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _get(body: Dict[str, Any], key: str, kind, default):
    value = body.get(key, default)
    if value is default:
        return value
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise BadRequest(key, f"expected an integer, got {value!r}")
    if kind is bool and not isinstance(value, bool):
        raise BadRequest(key, f"expected true or false, got {value!r}")
    return value


def parse_generate(body: Any) -> Tuple[List[GenerateRequest], bool, Dict[str, Any]]:
    """``/generate`` body -> (requests, whether the input was a batch, response options)."""
    if not isinstance(body, dict):
        raise BadRequest("body", "expected a JSON object")
    if "input_ids" not in body:
        if "text" in body:
            raise BadRequest("text", "the embedded server has no tokenizer; send input_ids")
        raise BadRequest("input_ids", "required (a list of token ids, or a list of such lists)")
    ids = body["input_ids"]
    if _is_int_list(ids) and ids:
        prompts, batch = [ids], False
    elif isinstance(ids, list) and ids and all(_is_int_list(p) and p for p in ids):
        prompts, batch = ids, True
    else:
        raise BadRequest("input_ids", "expected a non-empty list of token ids or a list of non-empty lists")
    if body.get("stream"):
        raise BadRequest("stream", "streaming is not supported by the embedded server")
    sp = body.get("sampling_params", {})
    if isinstance(sp, list):
        if len(sp) != len(prompts):
            raise BadRequest("sampling_params", f"{len(sp)} objects for {len(prompts)} prompts")
        params = [parse_sampling_params(s, f"sampling_params[{i}]") for i, s in enumerate(sp)]
    else:
        params = [parse_sampling_params(sp, "sampling_params")] * len(prompts)
    top_n = _get(body, "top_logprobs_num", int, 0)
    if top_n < 0:
        raise BadRequest("top_logprobs_num", f"expected >= 0, got {top_n}")
    start = _get(body, "logprob_start_len", int, -1)
    if start < -1:
        raise BadRequest("logprob_start_len", f"expected -1 (no prompt log-probs) or a prompt position >= 0, "
                         f"got {start}")
    routed = _get(body, "return_routed_experts", bool, False)
    routed_start = _get(body, "routed_experts_start_len", int, 0)
    if routed_start < 0:
        raise BadRequest("routed_experts_start_len", f"expected >= 0, got {routed_start}")
    rid = body.get("rid")
    rids = rid if isinstance(rid, list) else [rid] * len(prompts)
    if len(rids) != len(prompts) or not all(r is None or isinstance(r, str) for r in rids):
        raise BadRequest("rid", "expected a string, or one string per prompt")
    requests = [GenerateRequest(tuple(p), s, return_top_logprobs=top_n if body.get("return_logprob") else 0,
                                return_routed_experts=routed, rid=r) for p, s, r in zip(prompts, params, rids)]
    options = dict(return_logprob=_get(body, "return_logprob", bool, False), top_logprobs_num=top_n,
                   return_routed_experts=routed, routed_experts_start_len=routed_start, logprob_start_len=start)
    return requests, batch, options


def request_to_json(req: GenerateRequest, return_logprob: bool = True) -> Dict[str, Any]:
    body: Dict[str, Any] = dict(input_ids=list(req.prompt_ids), sampling_params=req.sampling.to_sglang(),
                                return_logprob=return_logprob)
    if req.return_top_logprobs:
        body["top_logprobs_num"] = req.return_top_logprobs
    if req.return_routed_experts:
        body["return_routed_experts"] = True
    if req.rid is not None:
        body["rid"] = req.rid
    return body


def encode_int32(array: torch.Tensor) -> str:
    return base64.b64encode(array.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")


def decode_routed(b64: str, layers: int, topk: int) -> torch.Tensor:
    import numpy as np

    flat = np.frombuffer(base64.b64decode(b64), dtype=np.int32)
    if layers <= 0 or topk <= 0 or flat.size % (layers * topk):
        raise ValueError(f"routed_experts has {flat.size} ints, not a multiple of layers*topk={layers}*{topk}")
    return torch.from_numpy(flat.copy()).view(-1, layers, topk)


def input_logprob_entries(prompt_ids: Sequence[int], logprobs: torch.Tensor, start: int) -> List[List[Any]]:
    """SGLang's ``input_token_logprobs`` from prompt position ``start``: ``[logprob, id, None]`` per token,
    the logprob of position 0 being ``None`` (nothing precedes it). ``logprobs``: ``[P - 1]`` teacher-forced
    log-probs of ``prompt_ids[1:]``."""
    values = [None] + [float(v) for v in logprobs.tolist()]
    return [[values[i], int(prompt_ids[i]), None] for i in range(start, len(prompt_ids))]


def prompt_logprobs_request(token_ids: Sequence[int]) -> Dict[str, Any]:
    """A ``/generate`` body that scores ``token_ids`` (SGLang and the embedded server). Temperature 1 so the
    answer is the plain log-softmax whether or not the server scales prompt log-probs by the temperature;
    one new token because SGLang's sampler always runs; no seed (SGLang's flashinfer sampler refuses it)."""
    return dict(input_ids=[int(t) for t in token_ids], return_logprob=True, logprob_start_len=0,
                sampling_params=dict(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, max_new_tokens=1))


def parse_input_logprobs(item: Any, token_ids: Sequence[int]) -> torch.Tensor:
    """``[L - 1]`` float32 log-probs of ``token_ids[1:]`` from the answer to :func:`prompt_logprobs_request`."""
    if isinstance(item, list) and len(item) == 1:
        item = item[0]
    meta = item.get("meta_info", {}) if isinstance(item, dict) else {}
    entries = meta.get("input_token_logprobs")
    if not isinstance(entries, list) or len(entries) != len(token_ids):
        got = "none" if not isinstance(entries, list) else f"{len(entries)} entries"
        raise ValueError(f"/generate returned {got} of meta_info.input_token_logprobs for a {len(token_ids)}-token "
                         "prompt with logprob_start_len=0 (expected one per prompt token)")
    ids = [int(e[1]) for e in entries]
    if ids != [int(t) for t in token_ids]:
        first = next(i for i, (a, b) in enumerate(zip(ids, token_ids)) if a != int(b))
        raise ValueError(f"input_token_logprobs are for other tokens: position {first} has id {ids[first]}, "
                         f"the prompt has {int(token_ids[first])}")
    values = [e[0] for e in entries[1:]]
    if any(v is None for v in values):
        raise ValueError("input_token_logprobs has a null log-prob after position 0")
    return torch.tensor(values, dtype=torch.float32)


def sample_to_json(s: Sample, options: Dict[str, Any], max_new_tokens: int,
                   input_logprobs: Optional[List[List[Any]]] = None) -> Dict[str, Any]:
    if s.finish_reason == "stop":
        finish = {"type": "stop", "matched": s.matched_stop}
    elif s.finish_reason == "length":
        finish = {"type": "length", "length": max_new_tokens}
    else:
        finish = {"type": "abort", "message": "aborted"}
    meta: Dict[str, Any] = {
        "id": s.rid, "finish_reason": finish, "prompt_tokens": len(s.prompt_ids),
        "completion_tokens": len(s.response_ids), "cached_tokens": 0, "weight_version": s.weight_version,
        "logprob_mode": s.logprob_mode,  # extension: which convention the log-probs follow
    }
    if options["return_logprob"] and input_logprobs is not None:
        meta["input_token_logprobs"] = input_logprobs
    if options["return_logprob"]:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(s.logprobs, s.response_ids)]
        if options["top_logprobs_num"] and s.top_logprob_ids is not None:
            meta["output_top_logprobs"] = [
                [[float(v), int(i), None] for v, i in zip(vals, ids)]
                for vals, ids in zip(s.top_logprob_values.tolist(), s.top_logprob_ids.tolist())]
    if options["return_routed_experts"] and s.routed_experts is not None:
        full = torch.cat([s.prompt_routed_experts, s.routed_experts], dim=0)[:-1]  # SGLang: all but the last
        meta["routed_experts"] = encode_int32(full[options["routed_experts_start_len"]:])
        meta["routed_experts_shape"] = [int(full.shape[1]), int(full.shape[2])]  # extension: [layers, topk]
    return {"text": "", "output_ids": list(s.response_ids), "meta_info": meta}


def sample_from_json(item: Dict[str, Any], req: GenerateRequest, sample_index: int,
                     routing_shape: Optional[Tuple[int, int]] = None, default_mode: str = "raw") -> Sample:
    """One ``/generate`` response item -> ``Sample`` (the request must have asked ``return_logprob``)."""
    meta = item["meta_info"]
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise ValueError("the /generate response has no meta_info.output_token_logprobs; send return_logprob=true")
    ids = [int(p[1]) for p in pairs]
    logprobs = [float(p[0]) for p in pairs]
    finish = meta.get("finish_reason") or {"type": "abort"}
    kind = finish.get("type", "abort") if isinstance(finish, dict) else str(finish)
    matched = finish.get("matched") if isinstance(finish, dict) else None
    top_ids = top_values = None
    if req.return_top_logprobs and meta.get("output_top_logprobs"):
        top = meta["output_top_logprobs"]
        top_values = torch.tensor([[float(e[0]) for e in row] for row in top], dtype=torch.float32)
        top_ids = torch.tensor([[int(e[1]) for e in row] for row in top], dtype=torch.int64)
    routed = prompt_routed = None
    if req.return_routed_experts and "routed_experts" not in meta and kind != "abort":  # aborted: may be absent
        raise ValueError("return_routed_experts was requested but the response has no meta_info.routed_experts; "
                         "was the server started with --enable-return-routed-experts?")
    if req.return_routed_experts and "routed_experts" in meta:
        shape = routing_shape or tuple(meta.get("routed_experts_shape") or ())
        if len(shape) != 2:
            raise ValueError("cannot decode routed_experts: give RemoteEngine routing_shape=(moe_layers, topk)")
        flat = decode_routed(meta["routed_experts"], *shape)
        P, R = len(req.prompt_ids), len(ids)
        if flat.shape[0] != P + R - 1:
            raise ValueError(f"routed_experts has {flat.shape[0]} rows, expected prompt+response-1 = {P + R - 1} "
                             "(routed_experts_start_len must be 0)")
        pad = torch.full((1, *shape), -1, dtype=torch.int32)  # the row SGLang never computes
        prompt_routed = flat[:P] if R else torch.cat([flat, pad])  # R == 0 (aborted early): P - 1 rows
        routed = torch.cat([flat[P:], pad])[:R]
    return Sample(
        prompt_ids=list(req.prompt_ids), response_ids=ids, logprobs=logprobs,
        finish_reason=kind if kind in ("stop", "length", "abort") else "abort",
        matched_stop=matched if isinstance(matched, int) and not isinstance(matched, bool) else None,
        top_logprob_ids=top_ids, top_logprob_values=top_values, routed_experts=routed,
        prompt_routed_experts=prompt_routed, weight_version=str(meta.get("weight_version", "default")),
        logprob_mode=meta.get("logprob_mode", default_mode), rid=meta.get("id"), sample_index=sample_index)


def encode_bucket(bucket: Sequence[Tuple[str, torch.Tensor]]) -> str:
    """A bucket as base64 safetensors bytes (CPU copy, contiguous; one entry per name)."""
    from safetensors.torch import save

    tensors: Dict[str, torch.Tensor] = {}
    for name, t in bucket:
        if name in tensors:
            raise ValueError(f"bucket names {name!r} twice")
        tensors[name] = t.detach().to("cpu").contiguous().clone()
    return base64.b64encode(save(tensors)).decode("ascii")


def write_bucket_file(bucket: Sequence[Tuple[str, torch.Tensor]], path: str) -> None:
    """A bucket as a safetensors file at ``path`` (``load_format="safetensors_file"``)."""
    from safetensors.torch import save_file

    tensors: Dict[str, torch.Tensor] = {}
    for name, t in bucket:
        if name in tensors:
            raise ValueError(f"bucket names {name!r} twice")
        tensors[name] = t.detach().to("cpu").contiguous().clone()  # views of one storage: safetensors refuses
    save_file(tensors, path)


def decode_bucket(b64: str) -> List[Tuple[str, torch.Tensor]]:
    from safetensors.torch import load

    return list(load(base64.b64decode(b64)).items())
