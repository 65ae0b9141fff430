"""The bench's parts without a run: workload files, overrides, the summary and the scaling table."""

import json
import statistics

import numpy as np
import pytest

from megatron_rl.bench import runner, summary, sweep
from megatron_rl.bench.workload import LengthDist, Workload, write_prompts


def test_prompt_file_has_the_drawn_lengths(tmp_path):
    from megatron_rl.bench.model import save_tokenizer
    from transformers import AutoTokenizer

    save_tokenizer(str(tmp_path / "tok"), 300)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    (tmp_path / "lens.jsonl").write_text("\n".join(json.dumps({"n": n}) for n in (3, 5, 5, 9)) + "\n")
    w = Workload.parse("lognormal:mean=12,sigma=0.4,cap=30", f"empirical:{tmp_path / 'lens.jsonl'},field=n")
    facts = write_prompts(str(tmp_path / "p.jsonl"), tok, w, 200, seed=3)
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    expect_p = w.prompt.draw(200, np.random.default_rng(3))
    expect_r = w.response.draw(200, np.random.default_rng(3))
    assert [len(tok(r["prompt"])["input_ids"]) for r in rows] == [max(1, int(p)) for p in expect_p]
    assert {r["max_new_tokens"] for r in rows} <= {3, 5, 9}
    assert facts["response_len_mean"] == pytest.approx(statistics.fmean(r["max_new_tokens"] for r in rows))
    assert len(expect_r) == 200 and max(expect_p) <= 30


def test_overrides_split_and_errors():
    run, bench = runner.split_overrides(["parallel.tp=2", "bench.response_len=fixed:9", "rollout.mode=async"])
    assert run == ["parallel.tp=2", "rollout.mode=async"] and bench["response_len"] == "fixed:9"
    with pytest.raises(ValueError, match="bench.respons_len: unknown bench setting; known: bench.model_config"):
        runner.split_overrides(["bench.respons_len=4"])
    with pytest.raises(ValueError, match="--mode='engines': one of full, trainer, engine"):
        runner.BenchSpec.from_args("x.yaml", [], mode="engines")
    assert "rollout.mode=sync" in runner.run_overrides(runner.BenchSpec("x.yaml", mode="trainer"), "p.jsonl", None)
    assert "rollout.mode=sync" not in runner.run_overrides(runner.BenchSpec("x.yaml"), "p.jsonl", None)
    with pytest.raises(ValueError, match="--mode engine with rollout.mode=async: .* runs in sync"):
        runner.BenchSpec.from_args("x.yaml", ["rollout.mode=async"], mode="engine")
    with pytest.raises(ValueError, match="--mode trainer with rollout.mode=one_step"):
        runner.BenchSpec.from_args("x.yaml", [], mode="trainer").with_overrides(["rollout.mode=one_step"], "o")
    with pytest.raises(ValueError, match="--sweep 'parallel.tp'"):
        sweep.parse_grid(["parallel.tp"])
    assert sweep.parse_grid(["parallel.tp=1,2"]) == [("parallel.tp", ["1", "2"])]


def _rows():
    rng = np.random.default_rng(0)
    out = []
    for step in range(1, 8):
        m = {"step": step, "time/step": 1.0 + rng.random(), "time/rollout": 0.4, "time/train": 0.3,
             "perf/tokens_per_s_per_gpu": 100 * rng.random(), "perf/rollout_tokens_per_s": 500.0 + step,
             "sync/link0/gb_per_s": 1.0, "sync/link1/gb_per_s": 3.0, "rollout/reward_mean": 0.5, "train/tokens": 64.0}
        out.append(m)
    return out


def test_summary_is_the_runs_own_metrics_over_the_timed_steps(tmp_path):
    rows = _rows()
    stats = summary.summarise(rows, warmup=2, engines=2)
    timed = rows[2:-1]  # warm-up and the last (checkpointing) step left out
    for key in ("time/step", "perf/tokens_per_s_per_gpu"):
        values = [m[key] for m in timed]
        assert stats[key]["median"] == statistics.median(values)
        assert stats[key]["spread"] == pytest.approx((max(values) - min(values)) / statistics.median(values))
    assert stats["bench/gen_tokens_per_s_per_engine"]["median"] == statistics.median(
        [m["perf/rollout_tokens_per_s"] / 2 for m in timed])
    assert stats["bench/sync_gb_per_s_per_link"]["median"] == 2.0
    assert stats["time/other"]["median"] == statistics.median([m["time/step"] - 0.7 for m in timed])
    assert "rollout/reward_mean" not in stats
    res = summary.write(str(tmp_path), rows, 2, 2, {"recipe": "r.yaml"})
    assert json.loads((tmp_path / "bench.json").read_text())["timed_steps"] == [3, 4, 5, 6]
    assert "| tokens/s/GPU |" in (tmp_path / "table.md").read_text() and res["table"].startswith("### r.yaml")
    assert (tmp_path / "phases.png").stat().st_size > 5000
    with pytest.raises(ValueError, match="no timed step"):
        summary.summarise(rows[:2], warmup=2, engines=1)
    # --mode engine: nothing trained, so no tokens/s/GPU (the run logs 0 for it), the rollout's figures stay
    engine = summary.summarise([{k: v for k, v in m.items() if k != "train/tokens"} for m in rows], 2, 2)
    assert "perf/tokens_per_s_per_gpu" not in engine and "bench/gen_tokens_per_s_per_engine" in engine


def test_scaling_table():
    pts = [{"name": "n1", "devices": 2, "stats": {"time/step": 2.0, "perf/tokens_per_s_per_gpu": 100.0,
                                                  "time/rollout": 1.0, "time/train": 0.5}},
           {"name": "n2", "devices": 4, "stats": {"time/step": 1.25, "perf/tokens_per_s_per_gpu": 80.0,
                                                  "time/rollout": 0.5, "time/train": 0.25, "time/weight_sync": 0.3}}]
    rows = sweep.scaling_rows(pts)
    assert rows[0]["efficiency"] == 1.0 and rows[1]["throughput"] == 320.0
    assert rows[1]["efficiency"] == pytest.approx(320.0 / 400.0) and rows[1]["grown"] == "weight_sync"
    assert "| n2 | 4 | 1.250 | 80.0 | 320.0 | 80% | weight_sync (+0.300) |" in sweep.scaling_table(pts)


def test_length_dist_max_and_describe():
    assert LengthDist.parse("fixed:5").max == 5 and LengthDist.parse("lognormal:mean=8,cap=20").max == 20
    assert LengthDist.parse("lognormal:mean=8,sigma=0.3,cap=20").describe() == "lognormal:mean=8,sigma=0.3,cap=20"


def test_rollout_generates_each_prompt_to_its_drawn_length(tmp_path):
    """ignore_eos + the prompt file's max_new_tokens column, through the real rollout phase and embedded engine."""
    from transformers import AutoTokenizer

    from megatron_rl.config import RolloutConfig, SamplingConfig
    from megatron_rl.data.config import DataConfig
    from megatron_rl.data.prompts import PromptDataset
    from megatron_rl.data.rewards import RewardConfig, RewardRunner
    from megatron_rl.data.sampler import PromptSampler
    from megatron_rl.orchestration.rollout_phase import RolloutPhase
    from megatron_rl.rollout.embedded.engine import EmbeddedEngine

    from run_helpers import quick_assets

    assets = quick_assets(tmp_path / "assets")
    tok = AutoTokenizer.from_pretrained(assets["student"])
    w = Workload.parse("fixed:6", "lognormal:mean=10,sigma=0.6,cap=24")
    write_prompts(str(tmp_path / "p.jsonl"), tok, w, 12, seed=1)
    data = DataConfig(path=str(tmp_path / "p.jsonl"), max_prompt_tokens=8, shuffle=False,
                      metadata_fields=("max_new_tokens",))
    sampler = PromptSampler.from_config(PromptDataset(data, tok))
    cfg = RolloutConfig(sampling=SamplingConfig(max_new_tokens=24, ignore_eos=True), n_samples_per_prompt=4,
                        prompts_per_step=12, dynamic_sampling=False)
    reward = RewardConfig(kind="custom", custom_fn="megatron_rl.bench.reward:bench_reward", in_process=True)
    phase = RolloutPhase(cfg, EmbeddedEngine.from_pretrained(assets["student"]), tok, sampler, RewardRunner(reward),
                         seed=0, batch_unit=4, progress_bars=False)
    try:
        batch = phase.collect(step=1, filter_groups=False)
    finally:
        phase.close()
    drawn = [g.record.metadata["max_new_tokens"] for g in batch.groups]
    assert len(drawn) == 12 and len(set(drawn)) > 3
    assert [[len(s.response_ids) for s in g.samples] for g in batch.groups] == [[n] * 4 for n in drawn]
    assert all(len(g.record.prompt_ids) == 6 for g in batch.groups)
    assert len({r for g in batch.groups for r in g.rewards}) > 10  # the bench reward varies: GRPO has signal


def test_random_model_from_an_hf_config(tmp_path):
    from megatron_rl.bench.model import random_model
    from megatron_rl.models.build import load_arch
    from transformers import AutoTokenizer

    cfg = {"model_type": "qwen3", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 128,
           "dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = random_model(str(tmp_path / "config.json"), str(tmp_path / "models"))
    assert random_model(str(tmp_path), str(tmp_path / "models")) == out  # reused: keyed by the config's content
    arch = load_arch(out)
    assert (arch.vocab_size, arch.hidden_size, arch.num_layers, arch.num_kv_heads) == (96, 32, 2, 1)
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 96 and tok.eos_token_id == 2 and tok("w5 w95")["input_ids"] == [5, 95]
    with pytest.raises(ValueError, match="bench.model_config=.*cannot read an HF config.json"):
        random_model(str(tmp_path / "missing.json"), str(tmp_path / "models"))
