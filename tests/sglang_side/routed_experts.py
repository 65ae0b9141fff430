"""`meta_info.routed_experts` exactly as SGLang 0.5.23 produces and decodes it, by SGLang's code.

Run with the SGLang venv's python (imports sglang, never megatron_rl):

    .venv-sglang/bin/python tests/sglang_side/routed_experts.py < input.json

SGLang's path: each MoE layer's `TopK` captures its top-k expert ids into a zeroed int32 buffer
`[tokens, num_hidden_layers, topk]` (`BaseDeviceCache.capture`: `buffer[:n, layer_id, :] = ids`;
dense layers are never written and stay 0); at the end of a request the scheduler reads the rows
`[start_len, seqlen - 1)` (`BaseTopkCapturer.get_topk`), the detokenizer base64-encodes the int32
bytes (`DetokenizerManager._b64_encode_per_request`) and the tokenizer manager puts the string in
`meta_info["routed_experts"]`. A client decodes it with `extract_routed_experts_from_meta_info`
(a flat int32 array) and reshapes it to `[-1, num_hidden_layers, topk]`.

Input (stdin, or argv[1] as a JSON literal or @file), any of:
    [[[...]]]                                     a full int array [tokens, num_hidden_layers, topk]
    {"routed_experts": [[[...]]]}                 the same
    {"capture": {"num_hidden_layers": L, "topk": k, "layers": {"<layer_id>": [[...] * tokens]}}}
                                                  per-MoE-layer ids [tokens, topk], captured into
                                                  the zeroed buffer as SGLang does
    {"start_len": s}                              (with either) SGLang's routed_experts_start_len
    {"decode": "<base64>", "num_hidden_layers": L, "topk": k}
                                                  decode a string only
Output (stdout): {"meta_info": {"routed_experts": "<base64>"}, "shape": [t, L, k],
                  "decoded_flat": [...], "decoded": [[[...]]]}
(for "decode" only: "decoded_flat" and, with L and k, "decoded").
"""

import sys
from types import SimpleNamespace

import _common


def _buffer(payload):
    import torch
    from sglang.srt.state_capturer.base import BaseDeviceCache

    if isinstance(payload, list):
        payload = {"routed_experts": payload}
    if "routed_experts" in payload:
        return torch.tensor(payload["routed_experts"], dtype=torch.int32)
    cap = payload["capture"]
    layers = {int(k): torch.tensor(v, dtype=torch.int32) for k, v in cap["layers"].items()}
    tokens = {t.shape[0] for t in layers.values()}
    if len(tokens) != 1:
        raise ValueError(f"routed_experts: every captured layer needs the same token count, got {tokens}")
    buf = torch.zeros((tokens.pop(), cap["num_hidden_layers"], cap["topk"]), dtype=torch.int32)
    holder = SimpleNamespace(buffer=buf)
    for layer_id, ids in sorted(layers.items()):
        BaseDeviceCache.capture(holder, layer_id, ids)
    return buf


def encode(payload) -> dict:
    import torch
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager
    from sglang.srt.state_capturer.base import BaseTopkCapturer

    buf = _buffer(payload)
    tokens = buf.shape[0]
    start_len = payload.get("start_len", 0) if isinstance(payload, dict) else 0
    # get_topk reads rows [start_len, seqlen - 1) through req_to_token (here the identity map).
    capturer = SimpleNamespace(host_cache=SimpleNamespace(buffer=buf))
    pool = SimpleNamespace(req_to_token=torch.arange(tokens + 1)[None, :])
    rows = BaseTopkCapturer.get_topk(capturer, req_pool_idx=0, seqlen=tokens + 1,
                                     req_to_token_pool=pool, start_len=start_len)
    encoded = DetokenizerManager._b64_encode_per_request([rows])[0]
    out = {"meta_info": {"routed_experts": encoded}, "shape": list(rows.shape)}
    out.update(decode(encoded, rows.shape[1], rows.shape[2]))
    return out


def decode(encoded: str, num_hidden_layers=None, topk=None) -> dict:
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    flat = extract_routed_experts_from_meta_info({"meta_info": {"routed_experts": encoded}})
    out = {"decoded_flat": flat.tolist()}
    if num_hidden_layers is not None and topk is not None:
        out["decoded"] = flat.reshape(-1, num_hidden_layers, topk).tolist()
    return out


def main(argv):
    _common.quiet()
    payload = _common.read_json_input(argv)
    if isinstance(payload, dict) and "decode" in payload:
        _common.dump(decode(payload["decode"], payload.get("num_hidden_layers"), payload.get("topk")))
    else:
        _common.dump(encode(payload))


if __name__ == "__main__":
    main(sys.argv)
