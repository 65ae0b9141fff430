"""SGLang's ``/update_weights_from_tensor`` payloads (``weights/tensor_payload.py``) on CPU tensors: the
flattened-bucket layout, the embedded server's decoder, and SGLang 0.5.23's own decoder.

SGLang's side runs in the SGLang venv (torch 2.14.1 + sglang 0.5.23 ``--no-deps``) through
``tests/sglang_side/deserialize_tensors.py``: FastAPI's body validation of ``UpdateWeightsFromTensorReqInput``,
``TpModelWorker.deserialize_own_rank`` (``MultiprocessingSerializer`` + ``SafeUnpickler``, after
``monkey_patch_torch_reductions``) and ``WeightUpdater.update_weights_from_tensor`` into a recording model;
it prints per-tensor checksums. Where: ``$SGLANG_VENV`` (default ``<repo>/.venv-sglang``) and
``$SGLANG_SIDE_DIR`` (default ``<repo>/tests/sglang_side``).
"""

import base64
import json
import os
import pickle
import subprocess
import sys
import types

import pytest
import torch

from megatron_rl.weights import tensor_payload as tp

from run_helpers import REPO


def _bucket():
    """Mixed dtypes (misaligned if packed back to back), a 0-dim tensor, a non-contiguous view."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    return [("model.embed_tokens.weight", torch.randn(7, 3, generator=g)),
            ("model.norm.weight", torch.randn(3, generator=g).to(torch.bfloat16)),
            ("lm_head.weight", base.t()),  # non-contiguous
            ("counter", torch.tensor(5, dtype=torch.int64)),
            ("model.layers.0.mlp.gate.weight", torch.randn(2, 3, generator=g, dtype=torch.float64))]


def test_flattened_layout_is_sglangs():
    named = _bucket()
    flat, metas = tp.flatten_bucket(named)
    assert flat.dtype == torch.uint8 and flat.numel() == metas[-1].end_idx
    for (name, t), m in zip(named, metas):
        assert m.name == name and m.shape == t.shape and m.dtype == t.dtype
        nbytes = t.numel() * t.element_size()
        assert m.start_idx % t.element_size() == 0 and m.end_idx - m.start_idx == m.numel == nbytes
        assert torch.equal(tp.view_of(flat, m), t)
    # bf16 [3] ends at byte 90: the next fp32 tensor starts at 92, the int64 one at 216 (not 212)
    assert [m.start_idx for m in metas] == [0, 84, 92, 216, 224]
    named[0][1].zero_()
    assert tp.view_of(flat, metas[0]).abs().sum() > 0  # a copy, not a view of the trainer's tensor
    one_dtype = [(f"w{i}", torch.randn(i + 1)) for i in range(4)]
    _, metas = tp.flatten_bucket(one_dtype)  # one dtype: packed back to back, as SGLang's own producer does
    assert [m.start_idx for m in metas] == [0, 4, 12, 24]


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_embedded_decoder_reads_every_rank_and_refuses_bad_payloads(load_format):
    named = _bucket()
    ranks = [tp.encode_bucket(named, load_format) for _ in range(2)]  # two ranks' copies
    out = tp.decode_payloads([p.text for p in ranks], load_format, tp_size=2)
    assert [n for n, _ in out] == [n for n, _ in named]
    assert all(a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(out, named))
    with pytest.raises(ValueError, match="1 payload.s. for 2 TP rank.s.: TP rank 1 has none"):
        tp.decode_payloads([ranks[0].text], load_format, tp_size=2)
    other = tp.encode_bucket(named[:2], load_format)
    with pytest.raises(ValueError, match="TP rank 1's payload differs from TP rank 0's"):
        tp.decode_payloads([ranks[0].text, other.text], load_format, tp_size=2)
    evil = base64.b64encode(pickle.dumps(os.system)).decode()
    with pytest.raises(pickle.UnpicklingError, match="Blocked unsafe global"):
        tp.decode_payloads([evil], load_format)


def test_sglangs_own_metadata_class_is_read(monkeypatch):
    """What slime sends: SGLang's FlattenedTensorMetadata (pickled by its module path) -- read by attribute."""
    module = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")

    class FlattenedTensorMetadata:  # stand-in with SGLang's path, so pickle writes SGLang's global
        def __init__(self, **kw):
            self.__dict__.update(kw)

    FlattenedTensorMetadata.__module__ = module.__name__
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    module.FlattenedTensorMetadata = FlattenedTensorMetadata
    for parent in ("sglang", "sglang.srt", "sglang.srt.weight_sync"):  # no SGLang here: stand-in packages
        monkeypatch.setitem(sys.modules, parent, sys.modules.get(parent) or types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    flat, metas = tp.flatten_bucket(_bucket())
    payload = tp._dump({"flattened_tensor": flat, "metadata": [FlattenedTensorMetadata(**vars(m)) for m in metas]},
                       cuda=False)
    assert b"sglang.srt.weight_sync.tensor_bucket" in base64.b64decode(payload)
    out = tp.decode_payload(payload, "flattened_bucket")
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(out, _bucket()))


# ---- SGLang's own decoder -----------------------------------------------------------------------------------


def _sglang_decoder():
    python = os.path.join(os.environ.get("SGLANG_VENV", str(REPO / ".venv-sglang")), "bin", "python")
    script = os.path.join(os.environ.get("SGLANG_SIDE_DIR", str(REPO / "tests" / "sglang_side")),
                          "deserialize_tensors.py")
    if not (os.path.exists(python) and os.path.exists(script)):
        pytest.skip(f"SGLang's decoder needs the SGLang venv ({python}) and {script}: set SGLANG_VENV / "
                    "SGLANG_SIDE_DIR")
    return python, script


def _summary(t: torch.Tensor):
    t64 = t.detach().to(torch.float64)
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "sum": float(t64.sum()),
            "sumsq": float((t64 * t64).sum())}


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_sglang_decodes_our_payloads(load_format):
    """The request body our client sends goes through SGLang's validation, ``deserialize_own_rank`` and
    ``update_weights_from_tensor`` on TP rank 1: it loads entry 1 (entry 0 here holds other values, to tell
    them apart) -- names, shapes, dtypes and values intact. The payloads stay alive while SGLang reads them."""
    python, script = _sglang_decoder()
    named = _bucket()
    ranks = [tp.encode_bucket([(n, t * 2) for n, t in named], load_format), tp.encode_bucket(named, load_format)]
    body = tp.request_body([p.text for p in ranks], load_format)
    proc = subprocess.run([python, script], input=json.dumps({"body": body, "tp_rank": 1}), capture_output=True,
                          text=True, timeout=600, cwd=os.path.dirname(script))
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert answer["ok"], answer
    got, expected = answer["tensors"], [{"name": n, **_summary(t)} for n, t in named]
    assert [g["name"] for g in got] == [e["name"] for e in expected]
    for g, e in zip(got, expected):
        assert (g["shape"], g["dtype"]) == (e["shape"], e["dtype"]), g["name"]
        assert g["sum"] == pytest.approx(e["sum"], rel=1e-12, abs=1e-12), g["name"]
        assert g["sumsq"] == pytest.approx(e["sumsq"], rel=1e-12), g["name"]
    del ranks
