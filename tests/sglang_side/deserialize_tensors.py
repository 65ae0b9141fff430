"""Decode an `/update_weights_from_tensor` body exactly as an SGLang 0.5.23 engine rank does.

Run with the SGLang venv's python (imports sglang, never megatron_rl):

    .venv-sglang/bin/python tests/sglang_side/deserialize_tensors.py < input.json

Input (stdin, or argv[1] as a JSON literal or @file): one job or a list of jobs
    {"body": {"serialized_named_tensors": ["<base64>", ...one per SGLang TP rank],
              "load_format": null | "flattened_bucket", ...}, "tp_rank": 0}
(each job is what engine rank `tp_rank` does with that body; a list runs them one after another
in this process, which unpickles every payload entry at most once, as the ranks of a server do).

SGLang's path, each step its own code: FastAPI parses the body into
`UpdateWeightsFromTensorReqInput` (the `Base64Bytes` marker base64-decodes every entry); the
tokenizer manager runs `normalize_serialized_named_tensor_payloads`; the rank's
`TpModelWorker.deserialize_own_rank` applies `monkey_patch_torch_reductions()` and unpickles only
entry `tp_rank` with `MultiprocessingSerializer.deserialize` (its `SafeUnpickler` allow-list);
the real `WeightUpdater.update_weights_from_tensor` then either unwraps each
`(name, tensor | LocalSerializedTensor)` with `_unwrap_tensor(tensor, tp_rank, device)` or, for
"flattened_bucket", reads `{"flattened_tensor", "metadata"}` (each metadata entry read by
attribute: name, shape, dtype, start_idx, end_idx, numel) into `FlattenedTensorBucket` and
`reconstruct_tensors()`, and hands the named tensors to `model.load_weights` (here a recorder).
Stand-ins: `device="cpu"`, the published runtime config that only answers
`weight_cache_mode == "off"`, and `get_parallel().tp_rank` overridden to `tp_rank`.

Output (stdout): per job (a list for a list of jobs)
                 {"ok": bool, "status": HTTP status of the body parse (200/400),
                  "stage": null | "validation" | "deserialize" | "load", "error": str | null,
                  "tensors": [{"name", "shape", "dtype", "sum", "sumsq"}] in load order}
"""

import sys
from types import SimpleNamespace

import _common


def decode(body: dict, tp_rank: int) -> dict:
    import torch
    from sglang.srt.managers.tp_worker import BaseTpWorker
    from sglang.srt.model_executor.model_runner_components import weight_updater as wu
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads

    out = {"ok": False, "status": None, "stage": None, "error": None, "tensors": []}
    route = _common.route_call("/update_weights_from_tensor", body)
    out["status"] = route.status
    if route.status != 200:
        out.update(stage="validation", error=str(route.response))
        return out
    req = route.obj
    req.serialized_named_tensors = normalize_serialized_named_tensor_payloads(req.serialized_named_tensors)

    loaded = []

    class Recorder(torch.nn.Module):
        def load_weights(self, named_tensors):
            loaded.extend((name, t.clone()) for name, t in named_tensors)

    model = Recorder()
    updater = wu.WeightUpdater(
        tp_rank=tp_rank, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
        get_model=lambda: model, update_model_fields=None, recapture_cuda_graph=None,
        get_model_runner=None,
    )
    wu.get_model = lambda: SimpleNamespace(weight_cache_mode="off")  # the unpublished config bag
    with get_parallel().override(tp_rank=tp_rank):
        try:
            named = BaseTpWorker.deserialize_own_rank(None, req.serialized_named_tensors)
        except Exception as e:  # noqa: BLE001
            out.update(stage="deserialize", error=f"{type(e).__name__}: {e}")
            return out
        try:
            ok, message = updater.update_weights_from_tensor(named_tensors=named, load_format=req.load_format)
        except Exception as e:  # noqa: BLE001
            ok, message = False, f"{type(e).__name__}: {e}"
    if not ok:
        out.update(stage="load", error=message)
        return out
    out["ok"] = True
    out["tensors"] = [{"name": name, **_common.tensor_summary(t)} for name, t in loaded]
    return out


def main(argv):
    _common.quiet()
    payload = _common.read_json_input(argv)
    jobs = payload if isinstance(payload, list) else [payload]
    results = [decode(job["body"], int(job.get("tp_rank", 0))) for job in jobs]
    _common.dump(results if isinstance(payload, list) else results[0])


if __name__ == "__main__":
    main(sys.argv)
