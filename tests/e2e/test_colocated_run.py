"""Colocated placement as colocated SGLang runs it, on CPU: an embedded engine that takes its weights in
SGLang's ``/update_weights_from_tensor`` format from the trainer rank beside it (``weight_transport=ipc``:
shared-memory files instead of CUDA-IPC handles), memory released and resumed by tag around training and
the sync (the embedded server refuses an update into released weights and generation without its KV
cache), and the trainer's optimizer state and gradient buffers offloaded while the engines run -- also
across checkpoints, which need them back."""

import math

import pytest

from megatron_rl.metrics import read_metrics

from run_helpers import TINY_RECIPE, check_ok, quick_assets, run_cli, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_colocated_ipc_run_with_trainer_offload_and_resume(tmp_path):
    assets = quick_assets(tmp_path / "assets")
    out = tmp_path / "run"
    extra = ["rollout.weight_transport=ipc", "rollout.offload_trainer=true", "checkpoint.interval=2",
             "checkpoint.save_hf=false"]  # 2 TP ranks: rank 0 beside the engine, rank 1 beside none
    check_ok(run_cli(["train", TINY_RECIPE, *tiny_overrides(assets, out, *extra, "stop_after_steps=2", steps=3,
                                                            warmup=3)], timeout=600))
    # the checkpoint is loaded into the offloaded trainer (its state comes back to the GPU for that)
    proc = run_cli(["train", TINY_RECIPE, *tiny_overrides(assets, out, *extra, "resume=true", steps=3, warmup=3)],
                   timeout=600)
    check_ok(proc)
    assert "resumed from" in proc.stderr and "at step 2" in proc.stderr
    lines = read_metrics(str(out))
    assert [m["step"] for m in lines] == [0, 1, 2, 3]
    for m in lines[1:]:
        assert m["sync/probe_max_abs_diff"] <= 1e-4 and math.isfinite(m["train/loss"])
        for phase in ("train", "sync", "rollout"):
            assert m[f"memory/{phase}/cpu_rss_gib"] > 0.1, (m["step"], phase)
        assert m["time/trainer_memory"] > 0 and m["time/engine_memory"] > 0
    assert lines[-1]["train/optimizer_step"] == 3.0
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter_0000003"
