"""Issue 28 items 2 (data) and 7: bad recipes, overrides, model configs and prompt files are each one line at
``megatron-rl train ... --dry-run`` (exit 2) naming the file or field -- not a traceback, a hang, a message of
megabytes or a run that crashes later. In-process CLI on the tiny recipe's assets."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from megatron_rl.cli import main as cli_main

from run_helpers import TINY_RECIPE, quick_assets, tiny_overrides


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return quick_assets(tmp_path_factory.mktemp("assets"))


def _dry_run(capsys, recipe, overrides):
    rc = cli_main(["train", recipe, *overrides, "--dry-run"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "config error" in line or line.startswith("  - ")]
    return rc, lines, err


def _bomb(levels: int = 9) -> str:
    text = 'a: &a ["x","x","x","x","x","x","x","x","x"]\n'
    for i in range(levels):
        prev, cur = chr(97 + i), chr(98 + i)
        text += f"{cur}: &{cur} [{','.join(['*' + prev] * 9)}]\n"
    return text + f"data: *{chr(97 + levels)}\n"  # ~9**10 values once expanded, under a known section


def _model_with(assets, tmp_path, **changes) -> str:
    d = tmp_path / "model"
    shutil.copytree(assets["student"], d)
    config = json.loads((d / "config.json").read_text())
    config.update(changes)
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


RECIPES = {  # name: (recipe text or bytes, expected in the one line)
    "deep_nesting": ("a: " + "[" * 10000 + "]" * 10000 + "\n", "nested more than"),
    "alias_bomb": (_bomb(), "alias bomb"),
    "duplicate_key": (open(TINY_RECIPE).read() + "\nseed: 3\n", "duplicate key 'seed' at line"),
    "latin1": ("# caf\xe9\nseed: 0\n".encode("latin-1"), "not UTF-8 text (byte 0xe9 at line 1)"),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_bad_recipe_is_one_line_naming_the_file(name, assets, tmp_path, capsys):
    text, expected = RECIPES[name]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(text if isinstance(text, bytes) else text.encode())
    rc, lines, err = _dry_run(capsys, str(recipe), tiny_overrides(assets, tmp_path / "out"))
    assert rc == 2, err[-2000:]
    assert len(lines) == 1 and expected in lines[0] and str(recipe) in lines[0], err[-2000:]
    assert len(err) < 1000, err[:1000]


OVERRIDES = {  # name: (override, expected in the one line)
    "5000_digit_int": ("seed=" + "9" * 5000, "an integer of 5000 digits"),
    "max_new_tokens_2**63": (f"rollout.sampling.max_new_tokens={2**63 - 1}", "rollout.sampling.max_new_tokens="),
    "n_samples_1e9": ("rollout.n_samples_per_prompt=1000000000", "rollout.n_samples_per_prompt=1000000000 must"),
    "prompts_1e9": ("rollout.prompts_per_step=1000000000", "rollout.prompts_per_step=1000000000 must"),
    "oversample_inf": ("rollout.oversample_factor=.inf", "rollout.oversample_factor=inf must"),
    "seed_-1": ("seed=-1", "seed=-1 must be an integer in [0, 4294967295]"),
    "threads_0": ("cluster.threads_per_worker=0", "cluster.threads_per_worker=0 must"),
    "cpus_-1": ("cluster.cpus_per_trainer=-1", "cluster.cpus_per_trainer=-1.0 must"),
    "request_timeout_0": ("rollout.request_timeout_s=0", "rollout.request_timeout_s=0.0 must"),
}


@pytest.mark.parametrize("name", list(OVERRIDES))
def test_out_of_range_setting_is_one_line_naming_the_field(name, assets, tmp_path, capsys):
    override, expected = OVERRIDES[name]
    rc, lines, err = _dry_run(capsys, TINY_RECIPE, [*tiny_overrides(assets, tmp_path / "out"), override])
    assert rc == 2, err[-2000:]
    assert len(lines) == 1 and expected in lines[0], err[-2000:]
    assert len(err) < 1000 and "Traceback" not in err


@pytest.mark.parametrize("key,value", [("hidden_size", -64), ("num_attention_heads", 0)])
def test_model_config_json_with_a_bad_size_fails_the_dry_run(key, value, assets, tmp_path, capsys):
    model = _model_with(assets, tmp_path, **{key: value})
    rc, lines, err = _dry_run(capsys, TINY_RECIPE, [*tiny_overrides(assets, tmp_path / "out"), f"model.hf_path={model}"])
    assert rc == 2, err[-2000:]
    assert len(lines) == 1 and f"config.json has {key}={value}" in lines[0] and model in lines[0], err[-2000:]


def _fifo(tmp_path):
    path = tmp_path / "prompts.jsonl"
    os.mkfifo(path)
    return [f"data.path={path}"], "is a FIFO (named pipe), not a file"


def _empty_parquet(tmp_path):
    path = tmp_path / "prompts.parquet"
    path.write_bytes(b"")
    return [f"data.path={path}"], f"data.path='{path}' cannot be read as parquet"


DATA = {
    "fifo": _fifo,  # used to block forever in open()
    "dev_zero": lambda tmp_path: (["data.path=/dev/zero", "data.format=jsonl"], "is a character device"),
    "empty_parquet": _empty_parquet,
}


@pytest.mark.parametrize("name", list(DATA))
def test_unreadable_prompt_file_is_one_line_naming_it(name, assets, tmp_path, capsys):
    extra, expected = DATA[name](tmp_path)
    rc, lines, err = _dry_run(capsys, TINY_RECIPE, [*tiny_overrides(assets, tmp_path / "out"), *extra])
    assert rc == 2, err[-2000:]
    assert len(lines) == 1 and expected in lines[0], err[-2000:]


def test_yaml_bounds_keep_ordinary_recipes():
    """Anchors, merge keys overriding merged values, and long-but-sane integers still load."""
    from megatron_rl import yaml_safe

    text = b"base: &b {x: 1, y: 2}\nd: {<<: *b, x: 3}\ne: *b\nbig: 123456789012345678901234567890\n"
    assert yaml_safe.load_bytes(text, "r") == {"base": {"x": 1, "y": 2}, "d": {"x": 3, "y": 2},
                                                "e": {"x": 1, "y": 2}, "big": 123456789012345678901234567890}
