"""Sampling math: SGLang filter semantics, raw vs processed log-probs, per-row RNG, param validation."""

import math

import pytest
import torch

from megatron_rl.rollout.client.protocol import SamplingParams, SamplingParamsError, derive_seed
from megatron_rl.rollout.embedded.sampling import (
    RowParams, make_generator, processed_logprob_reference, sample_next,
)

P4 = torch.tensor([0.5, 0.3, 0.15, 0.05])


def _draw(logits_row, params, rows=4000, mode="raw", seed=0):
    """``rows`` independent draws of one distribution (one generator each) in a single call."""
    logits = logits_row.unsqueeze(0).repeat(rows, 1)
    gens = [make_generator(derive_seed(seed, i)) for i in range(rows)]
    return sample_next(logits, RowParams.from_params([params] * rows), gens, mode)


@pytest.mark.parametrize("params, kept", [
    (SamplingParams(top_p=0.7), [0, 1]),  # mass before token 2 is 0.8 > 0.7
    (SamplingParams(top_p=0.8), [0, 1, 2]),  # mass before token 2 is 0.8 <= 0.8 (SGLang keeps it)
    (SamplingParams(top_k=3), [0, 1, 2]),
    (SamplingParams(min_p=0.5), [0, 1]),  # keep p >= 0.25
    (SamplingParams(top_k=3, top_p=0.6, min_p=0.01), [0, 1]),  # joint: intersection of the three
    (SamplingParams(), [0, 1, 2, 3]),
])
def test_hand_checked_raw_vs_processed(params, kept):
    res_raw = _draw(P4.log(), params, mode="raw")
    res_proc = _draw(P4.log(), params, mode="processed")
    assert torch.equal(res_raw.tokens, res_proc.tokens)  # the mode changes the log-prob, not the draw
    assert set(res_raw.tokens.tolist()) == set(kept)
    z = float(P4[kept].sum())
    for tok in kept:
        sel = res_raw.tokens == tok
        assert torch.allclose(res_raw.logprobs[sel], torch.tensor(math.log(P4[tok])), atol=1e-6)
        assert torch.allclose(res_proc.logprobs[sel], torch.tensor(math.log(P4[tok] / z)), atol=1e-6)
        # empirical frequency of the renormalised distribution (4000 draws: 4 sigma < 0.032)
        assert abs(sel.float().mean().item() - float(P4[tok]) / z) < 0.035


def test_temperature_and_greedy():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    res = _draw(logits, SamplingParams(temperature=2.0), rows=8)
    expected = torch.log_softmax(logits / 2.0, -1)[res.tokens]
    assert torch.allclose(res.logprobs, expected, atol=1e-6)
    greedy = _draw(logits, SamplingParams(temperature=0.0), rows=8)
    assert greedy.tokens.tolist() == [0] * 8
    # SGLang greedy: log_softmax of the unscaled logits; processed: the kept set is {argmax} -> 0
    assert torch.allclose(greedy.logprobs, torch.log_softmax(logits, -1)[0].expand(8), atol=1e-6)
    proc = _draw(logits, SamplingParams(temperature=0.0), rows=2, mode="processed")
    assert proc.logprobs.abs().max() < 1e-6


def test_processed_matches_float64_reference_on_random_cases():
    g = torch.Generator().manual_seed(1)
    for case in range(40):
        logits = torch.randn(50, generator=g) * 3
        params = SamplingParams(temperature=[0.0, 0.5, 1.0, 1.7][case % 4], top_p=[1.0, 0.9, 0.5][case % 3],
                                top_k=[-1, 5, 20][case % 3], min_p=[0.0, 0.05][case % 2])
        res = sample_next(logits.unsqueeze(0), RowParams.from_params([params]), [make_generator(case)],
                          "processed", top_n=3)
        tok = int(res.tokens[0])
        assert float(res.logprobs[0]) == pytest.approx(processed_logprob_reference(logits, tok, params), abs=1e-5)
        assert res.top_ids.shape == (1, 3)
        assert int(res.top_ids[0, 0]) == int(torch.argmax(logits))


def test_rows_are_independent_of_each_other():
    logits = torch.randn(3, 30)
    params = [SamplingParams(), SamplingParams(top_p=0.5), SamplingParams(temperature=0.3, top_k=4)]
    together = sample_next(logits, RowParams.from_params(params), [make_generator(s) for s in (7, 8, 9)])
    for i, s in enumerate((7, 8, 9)):
        alone = sample_next(logits[i:i + 1], RowParams.from_params([params[i]]), [make_generator(s)])
        assert int(alone.tokens[0]) == int(together.tokens[i])


def test_unfiltered_rows_skip_the_sort_but_not_the_semantics():
    """Unfiltered rows sample in token-id order (no sort): exact log-probs, raw == processed, the same
    stable top-n as the sorted path, zero-probability tokens never drawn."""
    logits = torch.tensor([0.0, float("-inf"), 1.0, 1.0, -2.0, float("-inf")])
    res = _draw(logits, SamplingParams(), rows=3000)
    proc = _draw(logits, SamplingParams(), rows=3000, mode="processed")
    assert torch.equal(res.tokens, proc.tokens) and torch.allclose(res.logprobs, proc.logprobs)
    assert set(res.tokens.tolist()) == {0, 2, 3, 4}
    assert torch.allclose(res.logprobs, torch.log_softmax(logits, -1)[res.tokens])
    p = torch.softmax(logits, -1)
    for tok in (0, 2, 3, 4):
        assert abs((res.tokens == tok).float().mean().item() - float(p[tok])) < 0.035
    gens = [make_generator(1)]
    top = sample_next(logits.unsqueeze(0), RowParams.from_params([SamplingParams()]), gens, top_n=3)
    ref = sample_next(logits.unsqueeze(0), RowParams.from_params([SamplingParams(top_k=6)]), [make_generator(1)],
                      top_n=3)
    assert top.top_ids.tolist() == ref.top_ids.tolist() == [[2, 3, 0]]  # ties: lower id first
    assert torch.allclose(top.top_values, ref.top_values)


def test_unfiltered_draw_at_the_end_of_the_cdf_takes_the_last_possible_token(monkeypatch):
    import megatron_rl.rollout.embedded.sampling as sampling

    # u * total can round up to the CDF's last value: never past the last token of non-zero probability
    monkeypatch.setattr(sampling, "_uniforms", lambda gens: torch.ones(len(gens), dtype=torch.float64))
    res = sample_next(torch.tensor([[0.0, 0.0, float("-inf")]]), RowParams.from_params([SamplingParams()]),
                      [make_generator(0)])
    assert res.tokens.tolist() == [1]


def test_derived_seeds_do_not_collide():
    seeds = {derive_seed(s, j) for s in range(50) for j in range(8)}
    assert len(seeds) == 400


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=0), "top_k"),
    (dict(top_k=2.5), "top_k"), (dict(min_p=1.2), "min_p"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(stop_token_ids=(1, -2)), "stop_token_ids"), (dict(n=0), "n"), (dict(seed=-1), "seed"),
])
def test_sampling_params_validation_names_field(kwargs, field):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert f"SamplingParams.{field}=" in str(info.value) and "expected" in str(info.value)
