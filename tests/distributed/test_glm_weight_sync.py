"""Weight sync of a GLM-4.5-style model at TP=2 (+SP) x EP=2 (ETP=1): q/k/v biases split over TP, the router's
float32 score bias and the shared expert (TP-split) reach the embedded engine bit-exact, by the three paths of
test_weight_sync (per rank in place, assembled into buckets, all-gather export); the post-sync probe passes."""

from __future__ import annotations

import pytest

from multiproc import run_distributed, tiny_hf_checkpoint

from test_weight_sync import ATOL, _layouts_child


@pytest.mark.timeout(240)
def test_glm4_moe_sync_is_bit_exact(tmp_path):
    glm = tiny_hf_checkpoint(str(tmp_path / "glm4_moe"), "glm4_moe")
    results = run_distributed(_layouts_child, 2, [("glm tp2 ep2", glm, dict(tp=2, ep=2, etp=1))], timeout_s=220)
    r = results[0]["glm tp2 ep2"]
    assert r["step0"] <= ATOL and r["stale"] is not None and "differ from the trainer's" in r["stale"]
    for path in ("in_place", "assembled", "all_gather"):
        s = r[path]
        print(f"\nglm4_moe tp2 ep2 {path}: synced max |diff| {s.check.max_abs_diff:.2e}, {s.tensors} tensors, "
              f"{s.bytes} bytes, per link {s.link_bytes}")
        assert s.check.max_abs_diff <= ATOL and r[path + "_differs"] == [], path  # bit-exact, every tensor
        assert (s.tensors, s.bytes) == (r["expected_tensors"], r["expected_bytes"]), path
        assert sum(s.link_bytes) == s.bytes and (s.link_bytes[1] > 0) == (path != "all_gather"), path
