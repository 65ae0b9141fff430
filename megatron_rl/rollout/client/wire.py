"""SGLang 0.5.23's native HTTP JSON <-> our typed records, shared by the embedded server and the HTTP
client so both ends encode the same way. Field semantics were read from SGLang's released source
(``srt/managers/io_struct.py``, ``srt/entrypoints/http_server.py``, ``srt/managers/tokenizer_manager.py``).

``/generate`` request: ``input_ids`` (one prompt or a list), ``sampling_params`` (one object or one per
prompt; SGLang's contract rejects unknown keys), ``return_logprob``, ``top_logprobs_num``,
``logprob_start_len`` (``>= 0``: prompt log-probs ``input_token_logprobs`` from that position, first entry
``None``, ids ``>= vocab_size - 1`` reported as 0), ``return_routed_experts``, ``routed_experts_start_len``,
``return_sampling_mask`` (adds ``output_token_sampling_logprobs``, the "processed" log-probs), ``rid``.
Response item: ``{"text", "output_ids", "meta_info": {"id", "finish_reason": {"type": "stop"|"length"|
"abort", ...}, "prompt_tokens", "completion_tokens", "weight_version", "weight_versions": [{"version", "start",
"end"}] (SGLang 0.5.23: which weight version produced which output tokens), "output_token_logprobs":
[[logprob, id, null]], "output_top_logprobs": [[[logprob, id, null], ...]], "routed_experts": base64}}``.
A single prompt with ``n > 1`` answers a list of ``n`` items, each child with a fresh ``id`` (not the
``rid`` sent); a batch answers one flat list, prompt-major.

``routed_experts``: base64 of int32 ``[rows, num_hidden_layers, topk]``, zeros in dense layers' columns;
rows for the sequence ``[routed_experts_start_len, prompt + completion - 1)`` (the last token is never
routed).

Weight buckets for ``/update_weights_from_tensor`` in the embedded server's own formats (extensions that
real SGLang refuses; the SGLang client path never sends them): ``load_format="safetensors"`` with base64
safetensors files, or ``"safetensors_file"`` with paths of safetensors files in the server's shared-memory
folder (what ``SGLangClient`` sends a server on its own machine). SGLang's own format (per-TP-rank
``MultiprocessingSerializer`` payloads) is in ``tensor_payload.py``.
"""

from __future__ import annotations

import base64
import math
import os
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from safetensors.torch import load, save, save_file

from megatron_rl.rollout.client.protocol import (
    ExpertLayout, GenerateRequest, Sample, SamplingParams, SamplingParamsError,
)
from megatron_rl.rollout.client.weight_versions import spans_from_meta, spans_to_meta

WEIGHT_FILE_PREFIX = "mrl-weights-"  # the only files load_format="safetensors_file" may name


def shared_dir() -> str:
    """Where same-machine weight files go: /dev/shm (memory) when writable, else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class BadRequest(ValueError):
    """A malformed ``/generate`` body; ``field`` names the offending JSON field. ``contract``: SGLang's schema
    gate refuses it (``{"error": "..."}``) rather than its request handling (``{"error": {"message"}}``)."""

    def __init__(self, field: str, message: str, contract: bool = False):
        super().__init__(f"{field}: {message}")
        self.field, self.message, self.contract = field, message, contract


def error_message(payload: Any) -> str:
    """The message of an SGLang error body, whatever its shape: ``{"error": {"message": m}}`` (request
    errors), ``{"error": m}`` (schema contract), ``{"success": false, "message": m}`` (weight endpoints),
    ``{"detail": [{"loc", "msg"}...]}`` (FastAPI validation), ``{"detail": m}``, or plain text."""
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict) and err.get("message") is not None:
            return str(err["message"])
        if err is not None:
            return "; ".join(map(str, err)) if isinstance(err, list) else str(err)
        if payload.get("message") is not None:
            return str(payload["message"])
        detail = payload.get("detail")
        if isinstance(detail, list):
            return "; ".join(f"{'.'.join(map(str, d.get('loc', [])))}: {d.get('msg')}" if isinstance(d, dict) else
                             str(d) for d in detail)
        if detail is not None:
            return str(detail)
    if payload is None or payload == "":
        return "(empty body)"
    return str(payload).strip()


# ---- /generate: server side ---------------------------------------------------------------------------

# sampling_params keys of SGLang's contract the embedded engine does not implement: accepted at their
# no-op value only (a client's defaults pass), refused otherwise.
_NOOP_SAMPLING_KEYS = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "min_new_tokens": (0,), "stop": (None, [], ""), "stop_regex": (None, [], ""), "regex": (None,),
    "json_schema": (None,), "ebnf": (None,), "structural_tag": (None,), "logit_bias": (None, {}),
    "custom_params": (None,), "beam_width": (None, 1), "watermark": (None,), "choice": (None, []),
    "stream_interval": (None,),
}
_FREE_SAMPLING_KEYS = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}
_SAMPLING_KEYS = {"temperature", "top_p", "top_k", "min_p", "max_new_tokens", "stop_token_ids", "n",
                  "ignore_eos", "sampling_seed"}
# /generate fields the embedded server refuses unless at their default (SGLang has them, we do not)
_UNSUPPORTED = {"text": None, "input_embeds": None, "image_data": None, "video_data": None, "audio_data": None,
                "lora_path": None, "session_params": None, "custom_logit_processor": None, "token_ids_logprob": None,
                "return_hidden_states": False, "sampling_logprobs_mode": None, "stream": False}


def parse_sampling_params(obj: Any, where: str) -> SamplingParams:
    """One ``sampling_params`` object, checked as SGLang's contract (unknown keys refused) and ``verify``."""
    if not isinstance(obj, dict):
        raise BadRequest(where, f"expected struct SamplingParams, got {type(obj).__name__}", contract=True)
    kwargs: Dict[str, Any] = {}
    for key, value in obj.items():
        if key in _SAMPLING_KEYS:
            if value is not None:
                kwargs["seed" if key == "sampling_seed" else key] = value
        elif key in _NOOP_SAMPLING_KEYS:
            if value not in _NOOP_SAMPLING_KEYS[key]:
                raise BadRequest(f"{where}.{key}", f"{value!r} is not supported by the embedded engine "
                                 f"(only {_NOOP_SAMPLING_KEYS[key][0]!r})")
        elif key not in _FREE_SAMPLING_KEYS:
            raise BadRequest(f"{where}.{key}", "unknown field (SGLang's SamplingParams rejects unknown keys)",
                             contract=True)
    if kwargs.get("temperature", 1.0) == 0:  # SGLang: temperature 0 is (temperature 1, top_k 1)
        kwargs.pop("top_k", None)
    kwargs["stop_token_ids"] = tuple(kwargs.get("stop_token_ids") or ())
    seed = kwargs.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and -(2**63) <= seed < 0:
        kwargs["seed"] = seed % (2**63)  # SGLang allows negative int64 seeds; ours are non-negative
    try:
        return SamplingParams(**kwargs)
    except SamplingParamsError as e:
        raise BadRequest(f"{where}.{'sampling_seed' if e.field == 'seed' else e.field}", str(e)) from None


def _is_id_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _per_prompt(body: Dict[str, Any], key: str, kind, default, count: int) -> List[Any]:
    """A field that may be one value or one per prompt (SGLang's ``normalize_param``)."""
    value = body.get(key)
    if value is None:
        return [default] * count
    values = value if isinstance(value, list) else [value] * count
    if len(values) != count:
        raise BadRequest(key, f"{len(values)} values for {count} prompts")
    for v in values:
        if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
            raise BadRequest(key, f"expected an integer, got {v!r}", contract=True)
        if kind is bool and not isinstance(v, bool):
            raise BadRequest(key, f"expected a boolean, got {v!r}", contract=True)
    return values


def parse_generate(body: Any) -> Tuple[List[GenerateRequest], bool, Dict[str, Any]]:
    """``/generate`` body -> (requests, whether the answer is a list, response options). Raises BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("body", "expected struct GenerateRequest", contract=True)
    for key, default in _UNSUPPORTED.items():
        if body.get(key, default) not in (default, None):
            raise BadRequest(key, "not supported by the embedded server" +
                             ("; it has no tokenizer: send input_ids" if key == "text" else ""))
    ids = body.get("input_ids")
    if ids is None:
        raise BadRequest("input_ids", "Either text, input_ids or input_embeds should be provided.")
    if _is_id_list(ids) and ids:
        prompts, batch = [ids], False
    elif isinstance(ids, list) and ids and all(_is_id_list(p) and p for p in ids):
        prompts, batch = ids, True
    elif isinstance(ids, list) and not ids:
        raise BadRequest("input_ids", "input_ids cannot be empty.")
    else:
        raise BadRequest("input_ids", "expected a list of token ids or a list of such lists", contract=True)
    for i, prompt in enumerate(prompts):
        bad = next((t for t in prompt if t < 0), None)
        if bad is not None:
            raise BadRequest("input_ids" if not batch else f"input_ids[{i}]", f"token id {bad} is negative")
    sp = body.get("sampling_params") or {}
    if isinstance(sp, list):
        if len(sp) != len(prompts):
            raise BadRequest("sampling_params", f"{len(sp)} objects for {len(prompts)} prompts")
        params = [parse_sampling_params(s, f"sampling_params[{i}]") for i, s in enumerate(sp)]
        if len({p.n for p in params}) > 1:
            raise BadRequest("sampling_params",
                             "The parallel_sample_num should be the same for all samples in sample params.")
    else:
        params = [parse_sampling_params(sp, "sampling_params")] * len(prompts)
    n = params[0].n
    logprob = _per_prompt(body, "return_logprob", bool, False, len(prompts))
    top_n = _per_prompt(body, "top_logprobs_num", int, 0, len(prompts))
    start = _per_prompt(body, "logprob_start_len", int, -1, len(prompts))
    mask = _per_prompt(body, "return_sampling_mask", bool, False, len(prompts))
    for name, values in (("return_logprob", logprob), ("top_logprobs_num", top_n), ("logprob_start_len", start),
                         ("return_sampling_mask", mask)):
        if n > 1 and isinstance(body.get(name), list):
            raise BadRequest(name, f"Cannot use list {name} with parallel_sample_num > 1")
    if any(k < 0 for k in top_n):
        raise BadRequest("top_logprobs_num", f"expected >= 0, got {min(top_n)}")
    routed = body.get("return_routed_experts", False)
    if not isinstance(routed, bool):
        raise BadRequest("return_routed_experts", f"expected a boolean, got {routed!r}")
    routed_start = body.get("routed_experts_start_len", 0)
    if isinstance(routed_start, bool) or not isinstance(routed_start, int) or routed_start < 0:
        raise BadRequest("routed_experts_start_len", f"expected an integer >= 0, got {routed_start!r}")
    rid = body.get("rid")
    if rid is None or isinstance(rid, str):
        rids = [rid] * len(prompts) if not batch or rid is None else [f"{rid}_{i}" for i in range(len(prompts))]
    elif isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if len(rid) != len(prompts):
            raise BadRequest("rid", "The specified rids length mismatch with the batch_size for batch processing.")
        if len(set(rid)) != len(rid):
            raise BadRequest("rid", f"Duplicate request IDs detected within the request: {rid}")
        rids = rid
    else:
        raise BadRequest("rid", "The rid should be a string or a list of strings.")
    requests = [GenerateRequest(tuple(p), s, return_top_logprobs=k if lp else 0, return_routed_experts=routed,
                                rid=r, return_sampling_logprobs=m)
                for p, s, lp, k, r, m in zip(prompts, params, logprob, top_n, rids, mask)]
    options = dict(return_logprob=logprob, top_logprobs_num=top_n, logprob_start_len=start, return_sampling_mask=mask,
                   return_routed_experts=routed, routed_experts_start_len=routed_start)
    return requests, batch or n > 1, options


def input_logprob_entries(prompt_ids: Sequence[int], logprobs: torch.Tensor, start: int,
                          vocab_size: int) -> List[List[Any]]:
    """SGLang's ``input_token_logprobs`` from prompt position ``start``: ``[logprob, id, None]`` per token, the
    log-prob of position 0 ``None`` (nothing precedes it), ids ``>= vocab_size - 1`` reported as 0 (SGLang
    clips them: ``logprob_result_processor.py``). ``logprobs``: ``[P - 1]`` log-probs of ``prompt_ids[1:]``."""
    values = [None] + [float(v) for v in logprobs.tolist()]
    ids = [int(t) if int(t) < vocab_size - 1 else 0 for t in prompt_ids]
    return [[values[i], ids[i], None] for i in range(start, len(prompt_ids))]


def encode_routed(routes: torch.Tensor) -> str:
    """``[rows, num_hidden_layers, topk]`` expert ids -> SGLang's base64 of int32 bytes."""
    return base64.b64encode(routes.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")


def decode_routed(b64: str, layout: ExpertLayout) -> torch.Tensor:
    """SGLang's ``routed_experts`` -> ``[rows, moe layers, topk]`` int32 (dense layers' zero columns dropped)."""
    flat = np.frombuffer(base64.b64decode(b64), dtype=np.int32)
    per_row = layout.num_layers * layout.topk
    if flat.size % per_row:
        raise ValueError(f"routed_experts has {flat.size} ints, not a multiple of num_hidden_layers*topk = "
                         f"{layout.num_layers}*{layout.topk}: is the model config the server's?")
    full = torch.from_numpy(flat.copy()).view(-1, layout.num_layers, layout.topk)
    return full[:, layout.moe_indices].contiguous()


def sample_to_json(s: Sample, options: Dict[str, Any], i: int, max_new_tokens: int,
                   input_logprobs: Optional[List[List[Any]]] = None,
                   layout: Optional[ExpertLayout] = None) -> Dict[str, Any]:
    """One response item for prompt ``i`` of the request."""
    if s.finish_reason == "stop":
        finish = {"type": "stop", "matched": s.matched_stop}
    elif s.finish_reason == "length":
        finish = {"type": "length", "length": max_new_tokens}
    else:
        finish = {"type": "abort", "message": s.abort_message or "aborted"}
    meta: Dict[str, Any] = {
        "id": s.rid, "finish_reason": finish, "prompt_tokens": len(s.prompt_ids), "weight_version": s.weight_version,
        "completion_tokens": len(s.response_ids), "cached_tokens": 0,
    }
    if s.weight_versions is not None:  # finished and aborted requests, as SGLang 0.5.23
        meta.update(spans_to_meta(s.weight_versions, len(s.response_ids)))
    if options["return_logprob"][i]:
        if input_logprobs is not None:
            meta["input_token_logprobs"] = input_logprobs
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(s.logprobs, s.response_ids)]
        if options["top_logprobs_num"][i] and s.top_logprob_ids is not None:
            meta["output_top_logprobs"] = [
                [[float(v), int(t), None] for v, t in zip(vals, ids)]
                for vals, ids in zip(s.top_logprob_values.tolist(), s.top_logprob_ids.tolist())]
    if options["return_sampling_mask"][i] and s.sampling_logprobs is not None:
        meta["output_token_sampling_logprobs"] = list(s.sampling_logprobs)
    if options["return_routed_experts"] and s.routed_experts is not None and layout is not None:
        moe = torch.cat([s.prompt_routed_experts, s.routed_experts], dim=0)[:-1]  # all but the last token
        full = torch.zeros(moe.shape[0], layout.num_layers, layout.topk, dtype=torch.int32)
        full[:, layout.moe_indices] = moe.to(torch.int32)
        meta["routed_experts"] = encode_routed(full[options["routed_experts_start_len"]:])
    return {"text": "", "output_ids": list(s.response_ids), "meta_info": meta}


# ---- /generate: client side ---------------------------------------------------------------------------


def request_to_json(req: GenerateRequest, *, sampling_logprobs: bool = False) -> Dict[str, Any]:
    """The body SGLang's ``/generate`` takes for one request (its ``n`` travels in ``sampling_params``)."""
    body: Dict[str, Any] = dict(input_ids=list(req.prompt_ids), sampling_params=req.sampling.to_sglang(),
                                return_logprob=True)
    if req.return_top_logprobs:
        body["top_logprobs_num"] = req.return_top_logprobs
    if req.return_routed_experts:
        body["return_routed_experts"] = True
    if sampling_logprobs or req.return_sampling_logprobs:
        body["return_sampling_mask"] = True
    if req.rid is not None:
        body["rid"] = req.rid
    return body


def batch_request_to_json(reqs: Sequence[GenerateRequest], *, sampling_logprobs: bool = False) -> Dict[str, Any]:
    """One ``/generate`` body for several requests in SGLang's batch form: per-item ``input_ids``,
    ``sampling_params`` and ``rid``; the rest is shared, so ``reqs`` must agree on it."""
    per_item = ("input_ids", "sampling_params", "rid")
    bodies = [request_to_json(r, sampling_logprobs=sampling_logprobs) for r in reqs]
    shared = [{k: v for k, v in b.items() if k not in per_item} for b in bodies]
    if any(r.rid is None for r in reqs) or any(s != shared[0] for s in shared):
        raise ValueError("batch_request_to_json: every request needs a rid and the same response options")
    return dict(shared[0], **{k: [b[k] for b in bodies] for k in per_item})


def prompt_logprobs_request(token_ids: Sequence[int], routed_experts: bool = False) -> Dict[str, Any]:
    """A ``/generate`` body that scores ``token_ids`` (SGLang and the embedded server). Temperature 1 so the
    answer is the plain log-softmax; one new token because SGLang's sampler always runs (it is never used).
    With ``routed_experts`` the answer also carries the routing of every prompt token."""
    body = dict(input_ids=[int(t) for t in token_ids], return_logprob=True, logprob_start_len=0,
                sampling_params=dict(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, max_new_tokens=1))
    if routed_experts:
        body["return_routed_experts"] = True
    return body


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
        raise ValueError(f"input_token_logprobs are for other tokens: position {first} has id {ids[first]}, the "
                         f"prompt has {int(token_ids[first])} (SGLang reports ids >= vocab_size - 1 as 0)")
    # null after position 0: a non-finite log-prob (JSON has no NaN; SGLang's orjson writes null): NaN, so that the
    # weight-sync probe reports the engine's non-finite log-probs as such
    return torch.tensor([_logprob(e[0]) for e in entries[1:]], dtype=torch.float32)


def parse_prompt_routes(item: Any, n_tokens: int, layout: ExpertLayout) -> torch.Tensor:
    """``[n_tokens, moe layers, topk]`` routing of a scored prompt (the answer to
    ``prompt_logprobs_request(..., routed_experts=True)``: prompt + 1 sampled token - 1 = ``n_tokens`` rows)."""
    if isinstance(item, list) and len(item) == 1:
        item = item[0]
    b64 = (item.get("meta_info") or {}).get("routed_experts") if isinstance(item, dict) else None
    if b64 is None:
        raise ValueError("the answer has no meta_info.routed_experts; start the server with "
                         "--enable-return-routed-experts")
    routes = decode_routed(b64, layout)
    if routes.shape[0] < n_tokens:
        raise ValueError(f"routed_experts has {routes.shape[0]} rows for a {n_tokens}-token prompt")
    return routes[:n_tokens]


def _logprob(value: Any, null: float = math.nan) -> float:
    """A log-prob of an answer: ``null`` stands for a non-finite one (SGLang's orjson and the embedded server write
    NaN and -inf as null): NaN, or ``null`` where -inf is the convention (tokens outside the kept set)."""
    return null if value is None else float(value)


def sample_from_json(item: Dict[str, Any], req: GenerateRequest, sample_index: int,
                     layout: Optional[ExpertLayout] = None, logprob_mode: str = "raw") -> Sample:
    """One ``/generate`` response item -> ``Sample`` (the request asked ``return_logprob``; with
    ``logprob_mode="processed"`` also ``return_sampling_mask``)."""
    meta = item["meta_info"]
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise ValueError("the /generate response has no meta_info.output_token_logprobs; send return_logprob=true")
    ids = [int(p[1]) for p in pairs]
    logprobs = [_logprob(p[0]) for p in pairs]
    finish = meta.get("finish_reason") or {"type": "abort"}
    kind = finish.get("type", "abort") if isinstance(finish, dict) else str(finish)
    matched = finish.get("matched") if isinstance(finish, dict) else None
    processed = meta.get("output_token_sampling_logprobs")
    if processed is not None and len(processed) != len(ids):
        raise ValueError(f"{len(processed)} output_token_sampling_logprobs for {len(ids)} output tokens")
    mode = "raw"
    if logprob_mode == "processed":
        if processed is None and kind != "abort":  # an aborted request may come back without them
            raise ValueError("logprob_mode='processed' but the response has no meta_info.output_token_sampling_logprobs"
                             " (send return_sampling_mask=true; SGLang >= 0.5.23)")
        if processed is not None:
            logprobs, mode = [_logprob(v) for v in processed], "processed"
    top_ids = top_values = None
    if req.return_top_logprobs and meta.get("output_top_logprobs"):
        top = meta["output_top_logprobs"]
        top_values = torch.tensor([[_logprob(e[0], -math.inf) for e in row] for row in top], dtype=torch.float32)
        top_ids = torch.tensor([[int(e[1]) for e in row] for row in top], dtype=torch.int64)
    routed = prompt_routed = None
    if req.return_routed_experts and "routed_experts" not in meta and kind != "abort":  # aborted: may be absent
        raise ValueError("return_routed_experts was requested but the response has no meta_info.routed_experts; "
                         "was the server started with --enable-return-routed-experts?")
    if req.return_routed_experts and "routed_experts" in meta:
        if layout is None:
            raise ValueError("cannot decode routed_experts: give the client the model's ExpertLayout")
        flat = decode_routed(meta["routed_experts"], layout)
        P, R = len(req.prompt_ids), len(ids)
        if flat.shape[0] != P + R - 1:
            raise ValueError(f"routed_experts has {flat.shape[0]} rows, expected prompt+response-1 = {P + R - 1} "
                             "(routed_experts_start_len must be 0)")
        pad = torch.full((1, len(layout.moe_indices), layout.topk), -1, dtype=torch.int32)  # never computed
        prompt_routed = flat[:P] if R else torch.cat([flat, pad])  # R == 0 (aborted early): P - 1 rows
        routed = torch.cat([flat[P:], pad])[:R]
    message = finish.get("message") if isinstance(finish, dict) and kind == "abort" else None
    spans = meta.get("weight_versions")
    return Sample(
        prompt_ids=list(req.prompt_ids), response_ids=ids, logprobs=logprobs,
        finish_reason=kind if kind in ("stop", "length", "abort") else "abort",
        matched_stop=matched if isinstance(matched, int) and not isinstance(matched, bool) else None,
        top_logprob_ids=top_ids, top_logprob_values=top_values, routed_experts=routed,
        prompt_routed_experts=prompt_routed, weight_version=str(meta.get("weight_version", "default")),
        logprob_mode=mode, rid=meta.get("id"), sample_index=sample_index,
        sampling_logprobs=None if processed is None else [_logprob(v) for v in processed],
        abort_message=str(message) if message is not None else None,
        weight_versions=None if spans is None else spans_from_meta(spans, len(ids)))


# ---- the embedded server's own weight formats (extensions) -----------------------------------------------


def _cpu_tensors(bucket: Sequence[Tuple[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    tensors: Dict[str, torch.Tensor] = {}
    for name, t in bucket:
        if name in tensors:
            raise ValueError(f"bucket names {name!r} twice")
        tensors[name] = t.detach().to("cpu").contiguous().clone()  # views of one storage: safetensors refuses
    return tensors


def encode_bucket(bucket: Sequence[Tuple[str, torch.Tensor]]) -> str:
    """A bucket as base64 safetensors bytes (``load_format="safetensors"``)."""
    return base64.b64encode(save(_cpu_tensors(bucket))).decode("ascii")


def write_bucket_file(bucket: Sequence[Tuple[str, torch.Tensor]], path: str) -> None:
    """A bucket as a safetensors file at ``path`` (``load_format="safetensors_file"``)."""
    save_file(_cpu_tensors(bucket), path)


def decode_bucket(b64: str) -> List[Tuple[str, torch.Tensor]]:
    return list(load(base64.b64decode(b64)).items())
