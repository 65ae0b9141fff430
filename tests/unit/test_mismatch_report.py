"""tools/mismatch_report.py on the tiny task's (barely) fine-tuned teacher, bf16 engine vs fp32: the DVP
bound |Δ log p| <= (1 − p)(e^{2ε} − 1) holds for every sampled token (it is a theorem; the engine's
generation path equals a bf16 re-forward), the tail/decade accounting adds up, the TRM bounds are ordered
as the paper's table, and the JSON and PNG are written."""

import importlib.util
import json
import os

import pytest

from run_helpers import nontrivial, quick_assets

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "mismatch_report.py")
_spec = importlib.util.spec_from_file_location("mismatch_report", _PATH)
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


def test_mismatch_law_report(tmp_path):
    assets = quick_assets(tmp_path / "assets")
    out = tmp_path / "mm.json"
    s = tool.main(["--model", assets["teacher"], "--prompts", assets["eval.jsonl"], "--max-prompts", "12",
                   "--samples", "8", "--out", str(out)])
    assert json.loads(out.read_text())["tokens"] == s["tokens"] > 50
    assert s["above_envelope_frac_reforward"] == 0.0 and s["above_envelope_frac_recorded"] == 0.0
    assert s["max_abs_recorded_minus_reforward"] < 1e-3 and 0 < s["eps_median"] <= s["eps_max"]
    assert sum(r["tokens"] for r in s["by_decade"]) == s["tokens"]
    assert sum(r["share_abs_dlogp"] for r in s["by_decade"]) == pytest.approx(1.0)
    assert 0 <= s["tail_share_abs_dlogp"] <= 1 and s["d_tok_max_kl"] >= s["mean_token_kl"] > 0
    for b in s["trm_bounds"]:
        assert b["unified"] <= min(b["pinsker_marginal_kl"], b["mixed_kl"]) and b["unified"] <= b["classical"]
    assert nontrivial(out.with_suffix(".png"))
