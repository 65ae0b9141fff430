"""Prompt data: loading (jsonl / parquet / saved HF dataset), chat templates, overlong prompts, the
checkpointable sampler, the arithmetic task and the tiny tokenizer. Real `datasets`/`tokenizers`."""

import json

import datasets
import pytest
from transformers import AutoTokenizer

from megatron_rl.data import DataConfig, PromptDataset, PromptSampler
from megatron_rl.data.arithmetic import all_problems, generate_problems, solve, write_arithmetic_dataset, write_jsonl
from megatron_rl.data.sampler import epoch_order
from megatron_rl.data.tiny_tokenizer import (
    BOS_ID, EOS_ID, PAD_ID, TINY_VOCAB_SIZE, UNK_ID, build_tiny_tokenizer, make_tiny_tokenizer)

datasets.disable_progress_bars()


@pytest.fixture(scope="module")
def make_cfg(tmp_path_factory):
    """DataConfig with a private `datasets` cache, so test runs leave nothing in ~/.cache."""
    cache = str(tmp_path_factory.mktemp("hf_cache"))
    return lambda **kw: DataConfig(cache_dir=cache, **kw)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_tok")
    make_tiny_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    return AutoTokenizer.from_pretrained(tok_dir)


@pytest.fixture(scope="module")
def rows():
    # Arithmetic prompts plus a few long ones (index 3, 7 and 11) for the overlong tests.
    out = generate_problems(16, seed=3)
    for i in (3, 7, 11):
        out[i] = {"prompt": "1+" * (10 + i) + "1=", "answer": str(11 + i)}
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory, rows):
    d = tmp_path_factory.mktemp("data")
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(d / "p.parquet"))
    table.save_to_disk(str(d / "saved"))
    datasets.DatasetDict({"train": table, "test": table.select(range(4))}).save_to_disk(str(d / "saved_dict"))
    return {"jsonl": write_jsonl(d / "p.jsonl", rows), "parquet": str(d / "p.parquet"),
            "hf_disk": str(d / "saved"), "hf_dict": str(d / "saved_dict")}


def _all(ds):
    return ds.records(range(len(ds)))


# -- loading -------------------------------------------------------------------------------------


def test_formats_load_identically(files, tokenizer, rows, make_cfg):
    loaded = {fmt: _all(PromptDataset(make_cfg(path=path, max_prompt_tokens=512), tokenizer))
              for fmt, path in files.items()}
    ref = loaded["jsonl"]
    assert len(ref) == len(rows)
    for fmt, recs in loaded.items():
        assert recs == ref, fmt
    r = ref[0]
    assert r.index == 0 and r.prompt_text == rows[0]["prompt"] and r.label == rows[0]["answer"]
    assert r.prompt_ids == tuple(tokenizer(rows[0]["prompt"])["input_ids"]) and r.prompt_ids[0] == BOS_ID


def test_hf_dict_split_and_metadata(files, tokenizer, tmp_path, make_cfg):
    ds = PromptDataset(make_cfg(path=files["hf_dict"], split="test"), tokenizer)
    assert len(ds) == 4
    with pytest.raises(ValueError, match=r"splits \['test', 'train'\]"):
        PromptDataset(make_cfg(path=files["hf_dict"], split="validation"), tokenizer)
    path = write_jsonl(tmp_path / "m.jsonl", [{"q": "1+2=", "a": 3, "src": "x"}])
    rec = PromptDataset(make_cfg(path=path, prompt_field="q", label_field="a", metadata_fields=["src"]), tokenizer)[0]
    assert rec.label == 3 and rec.metadata == {"src": "x"}


def test_config_errors_name_field_value_and_fix(files, tokenizer, tmp_path, make_cfg):
    with pytest.raises(ValueError, match=r"data.path='/nope.jsonl' does not exist"):
        make_cfg(path="/nope.jsonl")
    (tmp_path / "x.csv").write_text("a\n")
    with pytest.raises(ValueError, match=r"extension '.csv'.*data.format"):
        make_cfg(path=str(tmp_path / "x.csv"))
    with pytest.raises(ValueError, match=r"data.prompt_field: column 'question' .* available columns: \['prompt', 'answer'\]"):
        PromptDataset(make_cfg(path=files["jsonl"], prompt_field="question"), tokenizer)
    with pytest.raises(ValueError, match=r"data.label_field: column 'solution'.*or None for no label"):
        PromptDataset(make_cfg(path=files["parquet"], label_field="solution"), tokenizer)
    with pytest.raises(ValueError, match="data.overlong_policy='truncate'"):
        make_cfg(path=files["jsonl"], overlong_policy="truncate")
    with pytest.raises(ValueError, match="data.max_prompt_tokens=0"):
        make_cfg(path=files["jsonl"], max_prompt_tokens=0)


# -- chat template -------------------------------------------------------------------------------


def test_chat_template_applied_once(files, tokenizer, tmp_path, make_cfg):
    cfg = make_cfg(path=files["jsonl"], apply_chat_template=True, system_prompt="add", max_prompt_tokens=512)
    rec = PromptDataset(cfg, tokenizer)[0]
    q = generate_problems(16, seed=3)[0]["prompt"]
    assert rec.prompt_text == f"<bos><|system|>add<|user|>{q}<|assistant|>"
    assert rec.prompt_text == tokenizer.apply_chat_template(
        [{"role": "system", "content": "add"}, {"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
    assert rec.prompt_ids.count(BOS_ID) == 1 and rec.prompt_ids[:2] == (BOS_ID, 4) and rec.prompt_ids[-1] == 6
    # Rows that already hold chat messages are rendered as they are (system prompt put first).
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "2*3="}], "answer": "6"}])
    rec = PromptDataset(make_cfg(path=path, apply_chat_template=True, system_prompt="mul"), tokenizer)[0]
    assert rec.prompt_text == "<bos><|system|>mul<|user|>2*3=<|assistant|>"
    with pytest.raises(ValueError, match="holds chat messages but data.apply_chat_template=False"):
        PromptDataset(make_cfg(path=path), tokenizer)
    bare = build_tiny_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="has no chat_template"):
        PromptDataset(cfg, bare)


# -- overlong prompts ----------------------------------------------------------------------------


def test_overlong_dropped_and_counted(files, tokenizer, rows, make_cfg):
    lengths = [len(tokenizer(r["prompt"])["input_ids"]) for r in rows]
    limit = 30  # long row i has 2*(10+i) + 3 tokens: 29, 37, 45 for i = 3, 7, 11
    over = [i for i, n in enumerate(lengths) if n > limit]
    assert over == [7, 11]
    ds = PromptDataset(make_cfg(path=files["jsonl"], max_prompt_tokens=limit), tokenizer)
    assert ds.dropped_overlong == 2 and len(ds) == len(rows) - 2
    assert ds.stats["data/dropped_overlong"] == 2.0 and ds.stats["data/prompt_tokens_max"] <= limit
    assert [r.index for r in _all(ds)] == [i for i in range(len(rows)) if i not in over]


def test_overlong_error_names_index_and_length(files, tokenizer, rows, make_cfg):
    n7 = len(tokenizer(rows[7]["prompt"])["input_ids"])
    with pytest.raises(ValueError, match=rf"index 7 .* has {n7} tokens > data.max_prompt_tokens=30 \(2 of 16"):
        PromptDataset(make_cfg(path=files["parquet"], max_prompt_tokens=30, overlong_policy="error"), tokenizer)
    with pytest.raises(ValueError, match="all 16 prompts"):
        PromptDataset(make_cfg(path=files["jsonl"], max_prompt_tokens=2), tokenizer)


# -- sampler -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_ds(tokenizer, tmp_path_factory, make_cfg):
    path = write_arithmetic_dataset(tmp_path_factory.mktemp("ar") / "a.jsonl", num_problems=10, seed=1)
    return PromptDataset(make_cfg(path=path), tokenizer)


def _draw(sampler, sizes):
    return [[r.index for r in sampler.next_batch(n)] for n in sizes]


def test_sampler_deterministic_epochs_are_permutations(small_ds):
    a = _draw(PromptSampler(small_ds, seed=5), [3] * 10)
    assert a == _draw(PromptSampler(small_ds, seed=5), [3] * 10)
    assert a != _draw(PromptSampler(small_ds, seed=6), [3] * 10)
    flat = sum(a, [])
    for e in range(3):  # 30 draws = three full epochs, each visiting every prompt once
        assert sorted(flat[10 * e:10 * (e + 1)]) == list(range(10))
        assert flat[10 * e:10 * (e + 1)] == [int(p) for p in epoch_order(10, e, 5, True)]
    assert flat[:10] != flat[10:20]  # a fresh permutation each epoch
    assert sum(_draw(PromptSampler(small_ds, shuffle=False), [4, 4, 4]), []) == list(range(10)) + [0, 1]
    s = PromptSampler.from_config(small_ds)
    s.next_batch(25)  # larger than the dataset: wraps over two epoch boundaries
    assert (s.epoch, s.index, s.consumed) == (2, 5, 25)


@pytest.mark.parametrize("before", [[3], [4, 4], [7, 3], [9, 9, 5]], ids=["mid", "mid2", "boundary", "later"])
def test_sampler_resume_is_exact(small_ds, before):
    ref = PromptSampler(small_ds, seed=11)
    _draw(ref, before)
    state = ref.state_dict()
    expected = _draw(ref, [4, 6, 3])  # crosses at least one epoch boundary from every start point
    resumed = PromptSampler(small_ds, seed=11)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    assert _draw(resumed, [4, 6, 3]) == expected
    assert resumed.consumed == ref.consumed


def test_sampler_refuses_mismatched_state(small_ds):
    state = PromptSampler(small_ds, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1, shuffle=True but this sampler has seed=2"):
        PromptSampler(small_ds, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="saved over 11 prompts but this dataset has 10"):
        PromptSampler(small_ds, seed=1).load_state_dict({**state, "num_prompts": 11})
    with pytest.raises(ValueError, match="n_prompts=0"):
        PromptSampler(small_ds).next_batch(0)


# -- arithmetic task and tiny tokenizer ----------------------------------------------------------


def test_arithmetic_problems_deterministic_and_correct():
    a = generate_problems(200, seed=0, operators=("+", "-", "*"))
    assert a == generate_problems(200, seed=0, operators=("+", "-", "*"))
    assert a != generate_problems(200, seed=1, operators=("+", "-", "*"))
    for row in a:
        x, op, y = row["prompt"][0], row["prompt"][1], row["prompt"][2:-1]
        assert row["prompt"].endswith("=") and row["answer"] == str(solve(int(x), op, int(y)))
    plus = all_problems()
    assert len(plus) == 100 and {int(r["answer"]) for r in plus} == set(range(19))
    with pytest.raises(ValueError, match="operators"):
        generate_problems(3, operators=("/",))


def test_tiny_tokenizer_round_trips_and_loads(tok_dir, tokenizer):
    assert len(tokenizer) == TINY_VOCAB_SIZE == 64
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == \
        (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    texts = [t for r in all_problems(operators=("+", "-", "*")) for t in (r["prompt"], r["answer"])]
    texts += ["what is 3 + 4?\n(12.5, -7) / 2"]
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == BOS_ID and len(ids) == len(text) + 1 and UNK_ID not in ids  # one token per character
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode([10, 17, 11, 21, 11, EOS_ID, PAD_ID], skip_special_tokens=True) == "3+4=4"
    assert tokenizer.convert_ids_to_tokens(tokenizer("<|user|>1")["input_ids"]) == ["<bos>", "<|user|>", "1"]
    assert tokenizer.decode(list(range(64)))  # every id the model can emit decodes
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}],
                                         tokenize=False)
    assert chat == "<bos><|user|>1+1=<|assistant|>2<eos>"
