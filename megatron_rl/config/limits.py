"""Ranges of numeric settings that no section checks itself, so that a typo (a negative seed, 1e9 samples, an
infinite factor, 2**63 tokens) is one line at ``--dry-run`` instead of a traceback, an overflow or an
allocation of terabytes once the run starts. The upper bounds are far above any real run."""

from __future__ import annotations

import math
from typing import Any, List, Optional

from megatron_rl.config.run import RunConfig

MAX_SEED = 2**32 - 1  # numpy's seeds (and Ray's / torch's are as wide)
MAX_TOKENS = 1 << 20  # per sequence: prompt or response (Megatron's position ids, SGLang's context)
MAX_SAMPLES = 1 << 16  # samples per prompt
MAX_PROMPTS = 1 << 20  # prompts per step
MAX_BATCH = 1 << 22  # sequences per step
MAX_OVERSAMPLE = 100.0


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _range(out: List[str], field: str, value: Any, low: float, high: Optional[float] = None, *,
           fix: str = "", integer: bool = False) -> None:
    ok = isinstance(value, (int, float)) and math.isfinite(value) and value >= low and (high is None or value <= high)
    if not ok:
        span = f">= {_num(low)}" if high is None else f"in [{_num(low)}, {_num(high)}]"
        kind = "an integer" if integer else "a finite number"
        out.append(f"{field}={value!r} must be {kind} {span}{'; ' + fix if fix else ''}")


def limit_problems(cfg: RunConfig) -> List[str]:
    """One line per numeric setting outside its range."""
    out: List[str] = []
    r = cfg.rollout
    _range(out, "seed", cfg.seed, 0, MAX_SEED, integer=True, fix="e.g. seed=0")
    _range(out, "model.seed", cfg.model.seed, 0, MAX_SEED, integer=True)
    _range(out, "prepare.seed", cfg.prepare.seed, 0, MAX_SEED, integer=True)
    _range(out, "rollout.sampling.max_new_tokens", r.sampling.max_new_tokens, 1, MAX_TOKENS, integer=True,
           fix="the longest response, e.g. 1024")
    _range(out, "data.max_prompt_tokens", cfg.data.max_prompt_tokens, 1, MAX_TOKENS, integer=True)
    _range(out, "rollout.n_samples_per_prompt", r.n_samples_per_prompt, 1, MAX_SAMPLES, integer=True,
           fix="e.g. 8")
    _range(out, "rollout.prompts_per_step", r.prompts_per_step, 1, MAX_PROMPTS, integer=True, fix="e.g. 32")
    batch = r.n_samples_per_prompt * r.prompts_per_step
    if r.n_samples_per_prompt <= MAX_SAMPLES and r.prompts_per_step <= MAX_PROMPTS and batch > MAX_BATCH:
        out.append(f"rollout.prompts_per_step * rollout.n_samples_per_prompt = {r.prompts_per_step} * "
                   f"{r.n_samples_per_prompt} = {batch} sequences per step, more than {MAX_BATCH}; lower one of them")
    _range(out, "rollout.oversample_factor", r.oversample_factor, 1.0, MAX_OVERSAMPLE, fix="e.g. 1.5")
    _range(out, "rollout.request_timeout_s", r.request_timeout_s, 1e-3,
           fix="seconds a generation request may take, e.g. 600")
    c = cfg.cluster
    _range(out, "cluster.threads_per_worker", c.threads_per_worker, 1, 1024, integer=True, fix="e.g. 1")
    for name in ("cpus_per_trainer", "gpus_per_trainer", "cpus_per_engine", "gpus_per_engine"):
        _range(out, f"cluster.{name}", getattr(c, name), 0, 1024)
    if c.num_cpus is not None:
        _range(out, "cluster.num_cpus", c.num_cpus, 0, 1 << 20, fix="or null: enough for every worker")
    return out


def model_config_problems(field: str, path: str, config: Any) -> List[str]:
    """A model directory's ``config.json`` (the parsed mapping): the sizes that must be positive integers."""
    out: List[str] = []
    if not isinstance(config, dict):
        return [f"{field}={path!r}: config.json holds a {type(config).__name__}, not a mapping; restore the file"]
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size",
                "num_key_value_heads", "head_dim", "max_position_embeddings"):
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 31:
            out.append(f"{field}={path!r}: config.json has {key}={value!r}; it must be a positive integer (fix the "
                       "file, or download the model again)")
    return out
