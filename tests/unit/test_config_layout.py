"""The config package's shape: the rollout section's flat keys and its sub-sections are one field each (recipes,
overrides, attribute reads), a key given both ways must agree, and the config tree loads without torch."""

import subprocess
import sys

import pytest

from megatron_rl import config_io
from megatron_rl.config import ALIASES, RolloutConfig, resolve_mapping


def test_flat_and_nested_rollout_keys_build_the_same_section():
    flat = config_io.build(RolloutConfig, {"mode": "async", "max_staleness": 2, "partial": True, "num_engines": 3,
                                           "placement": "disaggregated", "weight_sync": {"bucket_mb": 64.0}})
    nested = config_io.build(RolloutConfig, {"overlap": {"mode": "async", "max_staleness": 2, "partial": True},
                                             "engines": {"count": 3, "placement": "disaggregated"},
                                             "weights": {"sync": {"bucket_mb": 64.0}}})
    assert flat == nested
    assert (flat.mode, flat.max_staleness, flat.num_engines, flat.weight_sync.bucket_mb) == ("async", 2, 3, 64.0)
    assert flat.overlapped and flat.off_policy is None
    for old, new in ALIASES.items():  # every flat name reads its sub-section's field (unset: resolved)
        section, key = new.split(".")
        if old != "deterministic_inference":
            assert getattr(flat, old) == getattr(getattr(flat, section), key), old
    assert flat.engines.deterministic_inference is None and flat.deterministic_inference is flat.seeded is True


def test_a_key_given_both_ways_must_agree_and_an_override_replaces_the_recipe():
    with pytest.raises(config_io.ConfigError, match=r"rollout.mode='async' and rollout.overlap.mode='sync'"):
        config_io.build(RolloutConfig, {"mode": "async", "overlap": {"mode": "sync"}})
    assert config_io.build(RolloutConfig, {"mode": "sync", "overlap": {"mode": "sync"}}).mode == "sync"
    assert resolve_mapping(None, ["rollout.mode=async", "rollout.engines.count=2"])["rollout"] == {
        "overlap": {"mode": "async"}, "engines": {"count": 2}}
    with pytest.raises(config_io.ConfigError, match="contradicts rollout.mode='async'"):
        config_io.build(RolloutConfig, {"off_policy": 1, "mode": "async"})
    assert config_io.build(RolloutConfig, {"off_policy": 1}).mode == "one_step"


def test_the_config_tree_imports_no_torch():
    code = "import sys, megatron_rl.config; print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
