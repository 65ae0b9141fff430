"""End-to-end runs of the MoE recipes (examples/tiny_cpu_moe.yaml, examples/tiny_cpu_deepseek.yaml,
examples/tiny_cpu_glm.yaml) with routing
replay on: a tiny Qwen3-MoE or DeepSeek-V3-style model at EP=2 over 2 Ray trainer ranks, the embedded engine
returning the experts it routed every token to, the trainer replaying them in the old-log-prob pass and the train step, the routing mask ANDed with token TIS.

Two warm-up steps and one GRPO step (dynamic sampling off: a random student scores 0 everywhere, and the
step must still train through the RL objective). Checks: metrics on disk, finite rewards, routing agreement
per MoE layer in [0, 1], replay applied to every routed token of the batch (``routing/replayed_tokens``), the
log-prob mismatch with replay at float32 round-off (the engine pinned to fp32, like the trainer), a
checkpoint.
"""

import math

import pytest

from megatron_rl.metrics import read_metrics

from run_helpers import MOE_RECIPE, check_ok, quick_assets, run_cli, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


RECIPES = {  # prepare.model -> (recipe, MoE layers)
    "qwen3_moe": (MOE_RECIPE, (0, 1)),  # both layers are MoE
    # examples/tiny_cpu_deepseek.yaml: MLA, layer 0 dense, layer 1 MoE with a shared expert and a sigmoid router
    "deepseek_v3": (MOE_RECIPE.replace("tiny_cpu_moe.yaml", "tiny_cpu_deepseek.yaml"), (1,)),
    # examples/tiny_cpu_glm.yaml: GQA with biases, q/k norm, partial RoPE; layer 0 dense, layer 1 DeepSeek's router
    "glm4_moe": (MOE_RECIPE.replace("tiny_cpu_moe.yaml", "tiny_cpu_glm.yaml"), (1,)),
}


@pytest.mark.parametrize("model", sorted(RECIPES))
def test_moe_recipe_runs_with_routing_replay(tmp_path, model):
    recipe, moe_layers = RECIPES[model]
    assets = quick_assets(tmp_path / "assets", model=model)
    out = tmp_path / "run"
    # an fp32 engine (pinned, whatever the recipe says): replay must reproduce its log-probs to round-off
    check_ok(run_cli(["train", recipe, *tiny_overrides(assets, out, "rollout.dynamic_sampling=false",
                                                           "rollout.embedded_dtype=float32",
                                                           "checkpoint.save_hf=false", steps=3, warmup=2)]))
    lines = read_metrics(str(out))
    assert [m["step"] for m in lines] == [0, 1, 2, 3]
    for m in lines[1:]:
        assert math.isfinite(m["rollout/reward_mean"]) and math.isfinite(m["train/loss"])
        for layer in moe_layers:
            assert 0.0 <= m[f"routing/agreement_layer{layer}"] <= 1.0, (m["step"], layer)
        # the train step's forward forced the engine's experts at every position a log-prob depends on, on
        # both EP ranks' halves of the batch: all but each sequence's last token, whose routing SGLang's
        # protocol does not return (it predicts nothing; its own router routes it)
        assert m["routing/replayed_tokens"] == m["train/tokens"] - m["train/sequences"], m["step"]
        # same weights, both fp32: with replay only round-off is left (a misaligned route would show here)
        assert m["routing/logprob_abs_diff"] < 1e-4 and m["routing/agreement_mean"] > 0.95, m["step"]
        assert m["routing_mask/seq_acceptance"] > 0.95
    assert [m["train/warmup"] for m in lines[1:]] == [1.0, 1.0, 0.0]  # step 3: the RL objective
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter_0000003"
