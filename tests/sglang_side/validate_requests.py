"""Judge HTTP request bodies exactly as SGLang 0.5.23's server does, with SGLang's own code.

Run with the SGLang venv's python (it imports sglang, never megatron_rl):

    .venv-sglang/bin/python tests/sglang_side/validate_requests.py < requests.json

Input (stdin, or argv[1] as a JSON literal or @file): either a list of requests, or
    {"vocab_size": V, "requests": [...]}
with each request {"endpoint": "/generate", "body": {...}, "method": "POST" (default), "query": {...}}.
`vocab_size` (the server model's vocabulary size) is required when a /generate request is given:
SGLang checks sampling params and `token_ids_logprob` against it.

Output (stdout): one JSON list, one entry per request, in order:
    {"endpoint", "method",
     "status": the HTTP status SGLang answers before the engine runs (200: accepted so far;
               404 no such route in 0.5.23; 405 wrong method; 400 refused; 500 a non-ValueError
               escaping the handler, e.g. an unknown sampling-params key),
     "ok": status == 200,
     "stage": where it was refused: "route" | "validation" | "contract" | "normalize" |
              "sampling_params" | "token_ids_logprob" | null,
     "error": the error message (null when ok), "response": SGLang's error body (null when ok),
     "request_class": the io_struct class the route parses the body into,
     "ignored_keys": body keys that class does not declare (SGLang drops them silently),
     "parsed": the parsed request object as JSON (bytes shown as {"bytes_len": n}),
     "expansion": /generate only, how the tokenizer manager fans the request out:
        {"is_single", "batch_size", "parallel_sample_num",
         "prefix_warmup_requests": one max_new_tokens=0 request per prompt when n > 1,
         "children": [{"prompt_index", "rid", "rid_source": "sent" | "suffixed" | "generated" |
                       "regenerated", "sampling_seed": as sent (null if unset),
                       "seed_if_deterministic": the seed used under
                       --enable-deterministic-inference (42 when unset; seeds are ignored without
                       that flag), "sampling_params": the normalized API sampling fields}]}}

Checked for /generate, in the server's order: FastAPI's dataclass parse of GenerateReqInput, the
JSON contract gate `generate_contract_error(body)`, `normalize_batch_and_arguments()`, then per
child request (the fan-out of `TokenizerManager._handle_batch_request`, rids regenerated with
`regenerate_rid()` when n > 1) `TokenizerManager._validate_token_ids_logprob` and
`SamplingParams(**sp)` + `.normalize(tokenizer)` + `.verify(vocab_size)`. Not checked (they need a
running server's config): context length, LoRA, watermark, hidden-states and custom-logit-processor
server flags. `normalize` gets a stand-in tokenizer (one id per UTF-8 byte) that only sizes the
stop-string buffer, as with a real tokenizer; it never refuses a request a real one would accept.
"""

import copy
import sys
from types import SimpleNamespace

import _common


class _ByteTokenizer:
    """Stands in for the server's tokenizer in SamplingParams.normalize (only sizes stop buffers)."""

    def encode(self, text, add_special_tokens=False):
        return list(text.encode("utf-8"))


_API_SAMPLING_FIELDS = (
    "max_new_tokens", "stop_strs", "stop_token_ids", "stop_regex_strs", "temperature", "top_p",
    "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "min_new_tokens", "n", "beam_width", "json_schema", "regex", "ebnf", "structural_tag",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params",
)


def _children(obj, sent_rid):
    """The per-child requests of TokenizerManager.generate_request / _handle_batch_request."""
    if obj.is_single:
        source = "sent" if sent_rid is not None else "generated"
        return [(0, obj, source)]
    objs = [obj[i] for i in range(obj.batch_size)]
    if obj.parallel_sample_num == 1:
        out = []
        for i, sub in enumerate(objs):
            if sent_rid is None:
                source = "generated"
            elif isinstance(sent_rid, list):
                source = "sent"
            else:
                source = "suffixed"  # _normalize_rid: f"{rid}_{i}"
            out.append((i, sub, source))
        return out
    out = []
    for i, sub in enumerate(objs):
        for _ in range(obj.parallel_sample_num):
            tmp = copy.copy(sub)
            tmp.regenerate_rid()  # what the tokenizer manager does for every child when n > 1
            out.append((i, tmp, "regenerated"))
    return out


def _refusal(stage, exc):
    status, response = _common.error_response(exc)
    error = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    return dict(status=status, stage=stage, error=error, response=response)


def _judge_generate(result, body, vocab_size):
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.sampling.sampling_params import SamplingParams

    contract_error = generate_contract_error(body)
    if contract_error is not None:
        return dict(status=400, stage="contract", error=contract_error,
                    response={"error": contract_error})
    obj = result.obj
    sent_rid = body.get("rid")
    try:
        obj.normalize_batch_and_arguments()
    except Exception as e:  # noqa: BLE001 - reported, as the server would answer it
        return _refusal("normalize", e)
    tm_self = SimpleNamespace(model_config=SimpleNamespace(vocab_size=vocab_size))
    children = []
    for prompt_index, child, rid_source in _children(obj, sent_rid):
        stage = "token_ids_logprob"
        try:
            TokenizerManager._validate_token_ids_logprob(tm_self, child)
            stage = "sampling_params"
            sp = SamplingParams(**dict(child.sampling_params))
            sp.normalize(_ByteTokenizer())
            sp.verify(vocab_size)
        except Exception as e:  # noqa: BLE001
            return _refusal(stage, e)
        seed = sp.sampling_seed
        children.append({
            "prompt_index": prompt_index,
            "rid": child.rid,
            "rid_source": rid_source,
            "sampling_seed": seed,
            "seed_if_deterministic": seed if seed is not None else 42,
            "sampling_params": {k: _common.to_builtins(getattr(sp, k)) for k in _API_SAMPLING_FIELDS},
        })
    n = obj.parallel_sample_num
    expansion = {
        "is_single": obj.is_single,
        "batch_size": obj.batch_size,
        "parallel_sample_num": n,
        "prefix_warmup_requests": obj.batch_size if n > 1 else 0,
        "children": children,
    }
    return dict(status=200, stage=None, error=None, response=None, expansion=expansion)


def judge(request: dict, vocab_size=None) -> dict:
    endpoint = request["endpoint"]
    method = request.get("method", "POST").upper()
    body = request.get("body")
    out = {"endpoint": endpoint, "method": method}
    result = _common.route_call(endpoint, body, method, request.get("query"))
    out.update(request_class=result.request_class, ignored_keys=result.ignored_keys)
    if result.status != 200:
        stage = "route" if result.status in (404, 405) else "validation"
        message = result.response.get("detail") or result.response.get("message")
        out.update(status=result.status, ok=False, stage=stage, error=message,
                   response=result.response, parsed=None)
        return out
    out["parsed"] = _common.to_builtins(result.obj) if result.obj is not None else None
    verdict = dict(status=200, stage=None, error=None, response=None)
    if endpoint == "/generate":
        verdict = _judge_generate(result, body, vocab_size)
    out.update(verdict)
    out["ok"] = out["status"] == 200
    return out


def main(argv):
    _common.quiet()
    payload = _common.read_json_input(argv)
    if isinstance(payload, dict):
        requests, vocab_size = payload["requests"], payload.get("vocab_size")
    else:
        requests, vocab_size = payload, None
    if vocab_size is None and any(r.get("endpoint") == "/generate" for r in requests):
        sys.exit("validate_requests: input field 'vocab_size' (the model's vocabulary size) is "
                 "required with a /generate request: {\"vocab_size\": V, \"requests\": [...]}")
    _common.dump([judge(r, vocab_size) for r in requests])


if __name__ == "__main__":
    main(sys.argv)
