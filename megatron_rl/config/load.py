"""Recipe + overrides -> a :class:`RunConfig` (each section validated as it is built), and the resolved config
back to YAML. :func:`megatron_rl.preflight.load_run_config` adds the generated assets and every check."""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Sequence

import yaml

from megatron_rl import config_io
from megatron_rl.config.rollout import ALIASES as ROLLOUT_ALIASES
from megatron_rl.config.rollout import normalize_keys as normalize_rollout_keys
from megatron_rl.config.run import RunConfig


def _strip_root(message: str) -> str:
    # Users write `rollout.n_samples_per_prompt=8`, not `RunConfig.rollout...`; and the rollout section's flat
    # names, which its messages use too.
    message = message.replace("RunConfig.", "").replace("RunConfig: ", "")
    for flat, nested in sorted(ROLLOUT_ALIASES.items(), key=lambda kv: -len(kv[1])):
        message = message.replace(f"rollout.{nested}", f"rollout.{flat}")
    return message


def resolve_mapping(recipe: Optional[str], overrides: Sequence[str] = ()) -> Dict[str, Any]:
    """Recipe YAML merged with dotted overrides (no building yet)."""
    base = config_io.load_yaml(recipe) if recipe else {}
    # each layer with its renamed keys in their new places first, so that an override of a flat key replaces the
    # recipe's nested one
    return config_io.merge(_renamed(base), _renamed(config_io.parse_overrides(list(overrides))))


def _renamed(mapping: Dict[str, Any]) -> Dict[str, Any]:
    rollout = mapping.get("rollout")
    if isinstance(rollout, Mapping):
        try:
            return {**mapping, "rollout": normalize_rollout_keys(rollout)}
        except config_io.ConfigError as e:
            raise config_io.ConfigError(str(e)) from None
    return mapping


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def build_run_config(mapping: Mapping[str, Any]) -> RunConfig:
    mapping = dict(mapping)
    optim = mapping.get("optim")
    if isinstance(optim, Mapping) and _number(optim.get("lr")) is not None \
            and not (math.isfinite(_number(optim["lr"])) and _number(optim["lr"]) > 0):
        raise config_io.ConfigError(f"optim.lr={_number(optim['lr']):g} must be a finite number > 0 (e.g. 1e-6)")
    if isinstance(optim, Mapping) and "lr" in optim and isinstance(optim.get("schedule"), Mapping) \
            and "lr" not in optim["schedule"]:
        # optim.lr is the peak LR; the schedule validates min_lr against its own lr when it is built, before
        # OptimConfig copies optim.lr into it. Give it optim.lr up front, so `optim.lr=...` alone suffices.
        mapping["optim"] = config_io.merge(optim, {"schedule": {"lr": optim["lr"]}})
    try:
        return config_io.build(RunConfig, mapping)
    except config_io.ConfigError as e:
        raise config_io.ConfigError([_strip_root(p) for p in e.problems]) from None


def dump_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (what the run writes to ``<output_dir>/config.yaml``)."""
    return yaml.safe_dump(config_io.to_dict(cfg), sort_keys=False)
