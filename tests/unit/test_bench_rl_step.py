"""tools/bench_rl_step.py without Ray or TRL: its model can never sample EOS (so both sides generate full-length
completions), its tokenizer and reward, and the summaries' checks."""

import importlib.util
import os

import pytest
import torch

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "bench_rl_step.py")
_spec = importlib.util.spec_from_file_location("bench_rl_step", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return bench.make_model(str(tmp_path_factory.mktemp("bench_model")), layers=2, hidden=64, vocab=256)


def test_eos_is_never_sampled_so_every_completion_is_full_length(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rl.rollout.embedded.engine import EmbeddedEngine
    from megatron_rl.rollout.client.protocol import GenerateRequest, SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = bench.make_prompts(str(tmp_path / "p.jsonl"), n=4, length=6, vocab=256)
    ids = [tok(r["prompt"])["input_ids"] for r in rows]
    assert all(len(x) == 6 and bench.BOS_ID not in x for x in ids)  # one token per word, no BOS added
    assert tok.decode(ids[0]) == rows[0]["prompt"]
    engine = EmbeddedEngine.from_pretrained(model_dir)
    samples = engine.generate([GenerateRequest(tuple(x), SamplingParams(max_new_tokens=24, n=8, seed=i,
                                                                        stop_token_ids=(bench.EOS_ID,)))
                               for i, x in enumerate(ids)])
    assert len(samples) == 32
    assert all(len(s.response_ids) == 24 and s.finish_reason == "length" for s in samples)
    # not luck: EOS's logit is far below every other token's at every position
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    seq = torch.tensor([ids[0] + samples[0].response_ids])
    with torch.no_grad():
        logits = model(seq).logits[0]
    others = torch.cat([logits[:, :bench.EOS_ID], logits[:, bench.EOS_ID + 1:]], dim=1)
    assert (logits[:, bench.EOS_ID] < others.min(dim=1).values - 50).all()


def test_reward_is_the_fraction_of_even_word_ids():
    assert bench.reward_fn("w4 w7 w10 w11") == 0.5
    assert bench.reward_fn("") == 0.0
    assert bench.trl_reward(["w4", "w5"]) == [1.0, 0.0]


def test_summaries_refuse_short_completions_and_split_the_step():
    spec = dict(warmup=1, steps=2, new_tokens=4, prompts=2, group=2, prompt_len=3)
    step = lambda t, n=4.0: {"time/step": t, "time/rollout": 1.0, "time/train": 2.0, "time/weight_sync": 0.5,  # noqa: E731
                             "train/tokens": 28.0, "rollout/response_len_mean": n}
    ours = bench.summarize_ours({"history": [step(9.0), step(4.0), step(6.0), step(7.0)]}, spec)
    assert ours["step_s"] == 5.0 and ours["phases"]["other"] == pytest.approx(1.5)
    with pytest.raises(RuntimeError, match="not all 4 tokens"):
        bench.summarize_ours({"history": [step(9.0), step(4.0, n=3.5)]}, spec)
    trl = {"times": {"begin": [0.0, 10.0, 14.0, 20.0], "end": [9.0, 13.0, 19.0, 25.0]},
           "sections": {"generate": [5.0, 1.0, 2.0, 1.0], "reward": [0.1] * 4, "gen_and_score": [6.0, 1.5, 2.5, 1.5]},
           "logs": [{"completions/mean_length": 4.0, "reward": 0.5}] * 4, "trl": "x",
           "gradient_accumulation_steps": 1}
    out = bench.summarize_trl(trl, spec)
    assert out["step_s"] == 5.0  # begin-to-begin of steps 1 and 2: 4 s and 6 s
    assert out["phases"]["rollout"] == 1.5 and out["phases"]["train"] == pytest.approx(3.0)
    trl["logs"] = [{"completions/mean_length": 3.0}]
    with pytest.raises(RuntimeError, match="not all 4 tokens"):
        bench.summarize_trl(trl, spec)
