"""Bad inputs against the rollout server (issue 28, server side), counted: clear 4xx / tracebacks / hangs.

    python tools/chaos_server.py [--json bench_results/chaos_server.json] [--only NAME]

Starts the embedded server over a tiny model in this process and sends every case of :func:`server_cases`, each
next to a well-formed ``/generate`` request that must still answer 200 (one client's bad request must not fail
another's). A case's verdict:

* ``clear``: a 4xx whose body is valid JSON (or text) with a message, the good request answered 200, the server
  healthy and not paused afterwards (``/health`` 200);
* ``accepted``: a 2xx (the input is valid for SGLang too, e.g. a temperature of 1e-45 is greedy) with valid JSON;
* ``traceback``: a 5xx, a body that is not valid JSON (bare ``NaN``), or the good request failing;
* ``hang``: no answer within the case's deadline;
* ``broken``: anything else (the server paused or unhealthy afterwards, a file written outside its folder).

``server_cases()`` is importable (``tools/chaos.py`` can run the same list against a recipe's server): each case
is ``(name, request)`` with ``request`` a dict: ``method``, ``path`` and ``body`` (JSON-able) or ``raw`` (the
request's bytes, sent on a fresh socket as they are); optional ``before`` / ``after`` lists of ``(method, path,
body)`` run around it unjudged, ``deadline_s`` (default 30).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

GOOD = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 8, "temperature": 0.7, "sampling_seed": 3,
                                                        "ignore_eos": True}}


def _gen(**sampling) -> Dict[str, Any]:
    """A /generate of 4 tokens with their log-probs (so that a non-finite one shows in the JSON answer)."""
    sp = {"max_new_tokens": 4, "ignore_eos": True}
    sp.update(sampling)
    return {"method": "POST", "path": "/generate", "body": {"input_ids": [5, 6, 7], "sampling_params": sp,
                                                            "return_logprob": True, "top_logprobs_num": 2}}


def _raw_json(path: str, text: str) -> Dict[str, Any]:
    data = text.encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    return {"raw": head.encode() + data}


def _nan_bucket(name: str, shape: Tuple[int, ...]) -> str:
    import torch
    from safetensors.torch import save

    t = torch.zeros(shape, dtype=torch.float32)
    t.view(-1)[0] = float("nan")
    return base64.b64encode(save({name: t})).decode("ascii")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_cases(weight: Optional[Tuple[str, Tuple[int, ...]]] = None,
                 outside: Optional[str] = None) -> List[Tuple[str, Dict[str, Any]]]:
    """The bad inputs. ``weight``: (name, shape) of one of the served model's parameters (the NaN-bucket case
    needs it; left out without); ``outside``: a folder outside the server's where /start_profile must not write."""
    outside = outside or tempfile.mkdtemp(prefix="chaos-outside-")
    existing = os.path.join(outside, "a-file")
    with open(existing, "w") as f:
        f.write("x")
    smuggled = b"POST /pause_generation HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
    cases: List[Tuple[str, Dict[str, Any]]] = [
        ("top_k 1e20 (float)", _gen(top_k=1e20)),
        ("top_k 10**20 (int)", _gen(top_k=10 ** 20)),
        ("top_k -5", _gen(top_k=-5)),
        ("top_k 0", _gen(top_k=0)),
        ("top_k 2**63", _gen(top_k=2 ** 63)),
        ("temperature NaN", _raw_json("/generate", '{"input_ids": [5, 6], "sampling_params": {"temperature": NaN, '
                                                   '"max_new_tokens": 4}}')),
        ("temperature Infinity", _raw_json("/generate", '{"input_ids": [5, 6], "sampling_params": {"temperature": '
                                                        'Infinity, "max_new_tokens": 4}}')),
        ("temperature -1", _gen(temperature=-1)),
        ("temperature 1e-45", _gen(temperature=1e-45)),
        ("temperature 1e-300", _gen(temperature=1e-300)),
        ("temperature '0.5' (string)", _gen(temperature="0.5")),
        ("top_p 0", _gen(top_p=0)),
        ("top_p 1.5", _gen(top_p=1.5)),
        ("top_p NaN", _raw_json("/generate", '{"input_ids": [5], "sampling_params": {"top_p": NaN}}')),
        ("min_p -0.1", _gen(min_p=-0.1)),
        ("min_p 2", _gen(min_p=2)),
        ("min_p NaN", _raw_json("/generate", '{"input_ids": [5], "sampling_params": {"min_p": NaN}}')),
        ("stop_token_ids 3 (not a list)", _gen(stop_token_ids=3)),
        ("stop_token_ids ['a']", _gen(stop_token_ids=["a"])),
        ("stop_token_ids [10**30]", _gen(stop_token_ids=[10 ** 30])),
        ("stop_token_ids {} (object)", _gen(stop_token_ids={"a": 1})),
        ("max_new_tokens 2**63-1", _gen(max_new_tokens=2 ** 63 - 1)),
        ("max_new_tokens -1", _gen(max_new_tokens=-1)),
        ("max_new_tokens 1e3 (float)", _gen(max_new_tokens=1e3)),
        ("n 0", _gen(n=0)),
        ("n 10**20", _gen(n=10 ** 20)),
        ("n 1.5", _gen(n=1.5)),
        ("repetition_penalty 0", _gen(repetition_penalty=0)),
        ("frequency_penalty 3", _gen(frequency_penalty=3)),
        ("presence_penalty NaN", _raw_json("/generate", '{"input_ids": [5], "sampling_params": {"presence_penalty": '
                                                        'NaN}}')),
        ("regex and json_schema both", _gen(regex="a+", json_schema="{}")),
        ("sampling_seed 2**64", _gen(sampling_seed=2 ** 64)),
        ("sampling_seed 'x'", _gen(sampling_seed="x")),
        ("ignore_eos 'yes'", _gen(ignore_eos="yes")),
        ("sampling_params a list of lists", {"method": "POST", "path": "/generate",
                                             "body": {"input_ids": [5], "sampling_params": [[1]]}}),
        ("input_ids [10**20]", {"method": "POST", "path": "/generate", "body": {"input_ids": [10 ** 20]}}),
        ("input_ids [1.5]", {"method": "POST", "path": "/generate", "body": {"input_ids": [1.5]}}),
        ("top_logprobs_num 10**20", {"method": "POST", "path": "/generate",
                                     "body": {"input_ids": [5], "return_logprob": True, "top_logprobs_num": 10 ** 20,
                                              "sampling_params": {"max_new_tokens": 2}}}),
        ("logprob_start_len 10**20", {"method": "POST", "path": "/generate",
                                      "body": {"input_ids": [5, 6], "return_logprob": True,
                                               "logprob_start_len": 10 ** 20, "sampling_params": {"max_new_tokens": 2}}}),
        ("JSON nested 100 000 deep", _raw_json("/generate", "[" * 100_000 + "]" * 100_000)),
        ("JSON nested 5 000 deep in a field", _raw_json("/generate", '{"input_ids": [5], "rid": ' + "[" * 5000
                                                        + "]" * 5000 + "}")),
        ("body not UTF-8", {"raw": b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\n\xff\xfe\xfd\xfc"}),
        ("weight version 1 MB", {"method": "POST", "path": "/update_weight_version",
                                 "body": {"new_version": "v" * (1 << 20), "abort_all_requests": False}}),
        ("weight_version 1 MB on a tensor update", {
            "method": "POST", "path": "/update_weights_from_tensor",
            "body": {"serialized_named_tensors": [], "load_format": "safetensors", "weight_version": "v" * (1 << 20)},
            "before": [("POST", "/begin_weight_update", {})], "after": [("POST", "/end_weight_update", {})]}),
        ("/start_profile output_dir ../", {"method": "POST", "path": "/start_profile",
                                           "body": {"output_dir": os.path.join(outside, "..", "escaped-profile")},
                                           "after": [("POST", "/stop_profile", {})]}),
        ("/start_profile output_dir an existing file", {"method": "POST", "path": "/start_profile",
                                                        "body": {"output_dir": existing},
                                                        "after": [("POST", "/stop_profile", {})]}),
        ("/start_profile output_dir 5 (not a string)", {"method": "POST", "path": "/start_profile",
                                                        "body": {"output_dir": 5},
                                                        "after": [("POST", "/stop_profile", {})]}),
        ("chunked body smuggling a /pause_generation (TE + CL)", {"raw": (
            b"POST /flush_cache HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
            + f"{len(smuggled):x}\r\n".encode() + smuggled + b"\r\n0\r\n\r\n")}),
        ("chunked body smuggling a /pause_generation (TE only)", {"raw": (
            b"POST /flush_cache HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + f"{len(smuggled):x}\r\n".encode() + smuggled + b"\r\n0\r\n\r\n")}),
        ("Transfer-Encoding gzip", {"raw": b"POST /flush_cache HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n"
                                           b"\r\n" + smuggled}),
        ("chunk size not hex", {"raw": b"POST /flush_cache HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                                       b"zz\r\n{}\r\n0\r\n\r\n"}),
        ("/init_weights_update_group to a dead port", {
            "method": "POST", "path": "/init_weights_update_group", "deadline_s": 120,
            "body": {"master_address": "127.0.0.1", "master_port": _free_port(), "rank_offset": 1, "world_size": 2,
                     "group_name": "chaos", "backend": "gloo"}}),
        ("/init_weights_update_group world_size 10**20", {
            "method": "POST", "path": "/init_weights_update_group",
            "body": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 10 ** 20,
                     "group_name": "chaos2", "backend": "gloo"}}),
    ]
    if weight is not None:
        name, shape = weight
        cases.append(("weight bucket holding NaN", {
            "method": "POST", "path": "/update_weights_from_tensor",
            "body": {"serialized_named_tensors": [_nan_bucket(name, shape)], "load_format": "safetensors",
                     "flush_cache": False},
            "before": [("POST", "/begin_weight_update", {})], "after": [("POST", "/end_weight_update", {})]}))
    return cases


# ---- sending --------------------------------------------------------------------------------------------


def _send_raw(host: str, port: int, data: bytes, deadline_s: float) -> Tuple[Optional[int], bytes]:
    """Send bytes; read until the server closes or ``deadline_s``: (status of the first answer, all bytes)."""
    with socket.create_connection((host, port), timeout=deadline_s) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks, end = [], time.monotonic() + deadline_s
        while time.monotonic() < end:
            try:
                b = s.recv(65536)
            except socket.timeout:
                break
            if not b:
                break
            chunks.append(b)
        out = b"".join(chunks)
        if not out:
            return None, out
        try:
            return int(out.split(b" ", 2)[1]), out
        except (IndexError, ValueError):
            return -1, out


def _http(host: str, port: int, method: str, path: str, body: Any, deadline_s: float) -> Tuple[Optional[int], bytes]:
    data = json.dumps(body).encode()
    head = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
            "\r\nConnection: close\r\n\r\n").encode()
    return _send_raw(host, port, head + data, deadline_s)


def _payload(raw: bytes) -> bytes:
    return raw.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in raw else b""


def _valid_json_or_text(raw: bytes) -> bool:
    body = _payload(raw)
    if b"application/json" not in raw.split(b"\r\n\r\n", 1)[0] or not body:
        return True
    try:
        json.loads(body, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(f"bare {c}")))
        return True
    except ValueError:
        return False


def run_case(host: str, port: int, name: str, req: Dict[str, Any]) -> Dict[str, Any]:
    deadline = req.get("deadline_s", 30.0)
    for m, p, b in req.get("before", []):
        _http(host, port, m, p, b, 30.0)
    good: Dict[str, Any] = {}

    def run_good():
        good["status"], good["raw"] = _http(host, port, "POST", "/generate", GOOD, 60.0)

    t = threading.Thread(target=run_good)
    t.start()
    tic = time.monotonic()
    try:
        if "raw" in req:
            status, raw = _send_raw(host, port, req["raw"], deadline)
        else:
            status, raw = _http(host, port, req["method"], req["path"], req["body"], deadline)
    except OSError as e:
        status, raw = None, str(e).encode()
    seconds = time.monotonic() - tic
    t.join(90)
    for m, p, b in req.get("after", []):
        _http(host, port, m, p, b, 30.0)
    health, _ = _http(host, port, "GET", "/health", {}, 60.0)
    if health != 200:  # a smuggled pause: put the server back for the next case, and say so
        _http(host, port, "POST", "/continue_generation", {}, 30.0)
    message = _payload(raw)[:200].decode("utf-8", "replace")
    if status is None:
        verdict = "hang"
    elif status >= 500 or status < 0 or not _valid_json_or_text(raw) or good.get("status") != 200:
        verdict = "traceback"
    elif health != 200:
        verdict = "broken"
    elif 400 <= status < 500:
        verdict = "clear"
    else:
        verdict = "accepted"
    return {"case": name, "status": status, "seconds": round(seconds, 2), "good_request": good.get("status"),
            "health_after": health, "verdict": verdict, "message": message}


def tiny_server(profile_dir: str):
    """The embedded server over a tiny random Qwen3 (no download), started on a free port; its /start_profile
    writes only in ``profile_dir``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from megatron_rl.rollout.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
    from megatron_rl.rollout.embedded.server import EmbeddedServer

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=512, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).eval()
    os.environ["SGLANG_TORCH_PROFILER_DIR"] = profile_dir  # the server's default --profile-dir (any version)
    return EmbeddedServer(EmbeddedEngine(model, EmbeddedEngineConfig(seeds="deterministic"))).start()


def campaign(work: str, names: Optional[List[str]] = None, only: Optional[str] = None) -> List[Dict[str, Any]]:
    """Start :func:`tiny_server` once (its profiles under ``work``), run the cases (those named in ``names`` /
    containing ``only``, all without), stop it; a /start_profile that wrote outside ``work/profiles`` is
    ``broken``."""
    os.makedirs(work, exist_ok=True)
    outside = os.path.join(work, "outside")
    os.makedirs(outside, exist_ok=True)
    saved = os.environ.get("SGLANG_TORCH_PROFILER_DIR")
    server = tiny_server(os.path.join(work, "profiles"))
    try:
        name, param = next(iter(server.engine.model.named_parameters()))
        host, port = server.httpd.server_address[:2]
        results = [run_case(host, port, n, r) for n, r in server_cases((name, tuple(param.shape)), outside)
                   if (names is None or n in names) and (only is None or only in n)]
    finally:
        server.stop()
        if saved is None:
            os.environ.pop("SGLANG_TORCH_PROFILER_DIR", None)
        else:
            os.environ["SGLANG_TORCH_PROFILER_DIR"] = saved
    escaped = os.path.exists(os.path.join(work, "escaped-profile"))
    for r in results:
        if escaped and r["case"].startswith("/start_profile output_dir ../"):
            r["verdict"] = "broken"
    return results


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=os.path.join("bench_results", "chaos_server.json"), help="write the results here")
    ap.add_argument("--only", default=None, help="run the cases whose name contains this")
    args = ap.parse_args(argv)
    results = campaign(tempfile.mkdtemp(prefix="chaos-server-"), only=args.only)
    print("| case | status | s | good request | /health after | verdict | message |\n|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['case']} | {r['status']} | {r['seconds']} | {r['good_request']} | {r['health_after']} | "
              f"{r['verdict']} | {r['message'][:90].replace('|', '/').replace(chr(10), ' ')} |")
    counts = {v: sum(r["verdict"] == v for r in results) for v in ("clear", "accepted", "traceback", "hang", "broken")}
    print(f"\n{len(results)} cases: " + ", ".join(f"{v} {c}" for v, c in counts.items()))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"cases": results, "counts": counts}, f, indent=1)
    return 0 if counts["traceback"] == counts["hang"] == counts["broken"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
