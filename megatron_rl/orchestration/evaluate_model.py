"""Stand-alone evaluation behind ``megatron-rl eval RECIPE_OR_HF_DIR [key=value ...] [--model HF_DIR]
[--output FILE]``: pass@k, mean@k per dataset (:mod:`megatron_rl.orchestration.evaluate`) of an HF model.

The target is a recipe (its ``model.hf_path``, ``eval``, ``reward`` and ``rollout.sampling``), a run
directory (its ``config.yaml``, and its ``hf_final/`` model when there is one), or an HF directory (then
``eval.data.path=...`` or ``eval.datasets.NAME.path=...`` and the ``reward.*`` fields come as overrides).
``--model`` evaluates another HF directory (e.g. ``megatron-rl export``'s output) with the recipe's
reward and data. Engines: ``rollout.engine`` ``embedded`` (the SGLang-compatible server in a child
process), ``sglang`` (a server launched here) or ``remote`` (``rollout.urls``, whatever they serve).
Prints a markdown table; ``--output`` also writes the metrics as JSON. Exit codes: 0, 2 config error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from transformers import AutoConfig, AutoTokenizer

from megatron_rl import config_io
from megatron_rl.config import EvalConfig, RolloutConfig
from megatron_rl.config_io import ConfigError
from megatron_rl.data.prompts import PromptDataset
from megatron_rl.data.rewards.config import RewardConfig
from megatron_rl.data.rewards.runner import RewardRunner
from megatron_rl.orchestration.engine_worker import EngineSpec, EngineWorker
from megatron_rl.orchestration.evaluate import Evaluator
from megatron_rl.orchestration.rollout_phase import RolloutPhase
from megatron_rl.preflight import load_run_config
from megatron_rl.rollout.client.balancer import RemoteEngine
from megatron_rl.rollout.client.http_client import SGLangClient


@dataclass
class EvalSetup:
    model: str
    tokenizer: str
    eval: Any  # EvalConfig
    reward: Any  # RewardConfig
    rollout: Any  # RolloutConfig
    seed: int = 0


def _is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def resolve(target: str, overrides, model: Optional[str] = None) -> EvalSetup:
    """The model, tokenizer and config sections an evaluation needs (raises ``ConfigError``)."""
    if os.path.isdir(target) and os.path.isfile(os.path.join(target, "config.yaml")):  # a run directory
        final = os.path.join(target, "hf_final")
        model = model or (final if _is_hf_dir(final) else None)
        target = os.path.join(target, "config.yaml")
    if os.path.isfile(target):
        cfg = load_run_config(target, overrides, check=False)
        path = model or cfg.model.hf_path
        tokenizer = path if model and os.path.isfile(os.path.join(model, "tokenizer_config.json")) else cfg.tokenizer_path
        setup = EvalSetup(path, tokenizer, cfg.eval, cfg.reward, cfg.rollout, cfg.seed)
    elif _is_hf_dir(target):
        mapping = config_io.parse_overrides(list(overrides))
        unknown = sorted(set(mapping) - {"eval", "reward", "rollout", "seed"})
        if unknown:
            raise config_io.ConfigError(f"overrides {unknown}: evaluating an HF directory takes eval.*, reward.*, "
                                        "rollout.* and seed only")

        def section(cls, name):
            return config_io.build(cls, mapping.get(name) or {}, name)

        path = model or target
        setup = EvalSetup(path, path, section(EvalConfig, "eval"), section(RewardConfig, "reward"),
                          section(RolloutConfig, "rollout"), int(mapping.get("seed", 0)))
    else:
        raise config_io.ConfigError(f"{target!r} is neither a recipe file, a run directory (config.yaml) nor an HF "
                                    "directory (config.json)")
    if not setup.eval.named_datasets:
        raise config_io.ConfigError("nothing to evaluate: give eval.data.path=FILE or eval.datasets.NAME.path=FILE")
    return setup


def _engine(setup: EvalSetup, closers: list):
    """A RemoteEngine over the servers the rollout config names (started here for embedded / sglang, the way
    the run's engine workers start them, in this process)."""
    r = setup.rollout
    if r.engine == "remote":
        urls = list(r.urls)
    else:
        import torch

        worker = EngineWorker(EngineSpec(kind=r.engine, model_path=setup.model, deterministic=r.deterministic_inference,
                                         seed=setup.seed, dtype=r.embedded_dtype, sglang=r.sglang,
                                         threads=torch.get_num_threads()))
        closers.append(worker.stop)
        urls = [worker.start()]
    remote = RemoteEngine([SGLangClient(u, timeout_s=r.request_timeout_s, logprob_mode=r.logprob_mode,
                                        max_in_flight=r.max_samples_in_flight) for u in urls],
                          policy=r.balancer, max_concurrency=r.max_concurrency)
    closers.append(remote.shutdown)
    return remote


def evaluate(setup: EvalSetup, step: int = 0, progress: bool = True) -> Dict[str, Dict[str, float]]:
    """Per dataset, its metrics (``pass@j``, ``mean@n``, ...)."""
    closers: list = []
    try:
        tokenizer = AutoTokenizer.from_pretrained(setup.tokenizer)
        try:  # an empty file, every prompt too long...: the config's problem, said as train says it
            fitted = fit_context(setup)
            datasets = {name: PromptDataset(d, tokenizer) for name, d in fitted.items()}
            for name, d in fitted.items():
                if d is not setup.eval.named_datasets[name] and datasets[name].dropped_overlong:
                    print(f"megatron-rl eval: {name}: {datasets[name].dropped_overlong} prompts over "
                          f"{d.max_prompt_tokens} tokens left out (the model's context minus "
                          f"rollout.sampling.max_new_tokens={setup.rollout.sampling.max_new_tokens})", file=sys.stderr)
            rewards = RewardRunner(setup.reward)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        closers.append(rewards.close)
        phase = RolloutPhase(setup.rollout, _engine(setup, closers), tokenizer, None, rewards, seed=setup.seed,
                             batch_unit=1, progress_bars=progress)
        closers.append(phase.close)
        return Evaluator(setup.eval, datasets, phase, setup.seed).evaluate(step)
    finally:
        for close in reversed(closers):
            close()


def fit_context(setup: EvalSetup) -> Dict[str, Any]:
    """The eval datasets with ``max_prompt_tokens`` lowered so that a prompt plus ``rollout.sampling.max_new_tokens``
    fits the model's context (longer prompts are dropped and counted, as ``overlong_policy="drop"`` does; with
    ``"error"`` the dataset names them): the engine would otherwise reject them mid-evaluation (:func:`evaluate`
    says how many it left out). Raises ``ConfigError`` when not even one prompt token fits."""
    context = getattr(AutoConfig.from_pretrained(setup.model), "max_position_embeddings", None)
    new_tokens = setup.rollout.sampling.max_new_tokens
    if context is None:
        return dict(setup.eval.named_datasets)
    room = context - new_tokens
    if room < 1:
        raise ConfigError(f"rollout.sampling.max_new_tokens={new_tokens} leaves no room for a prompt in the context "
                          f"length {context} of {setup.model} (max_position_embeddings); lower it below {context}")
    out = {}
    for name, d in setup.eval.named_datasets.items():
        if d.max_prompt_tokens > room:
            d = dataclasses.replace(d, max_prompt_tokens=room)
        out[name] = d
    return out


def markdown_table(results: Mapping[str, Mapping[str, float]]) -> str:
    keys = ["prompts"] + [k for k in next(iter(results.values())) if k.startswith(("mean@", "pass@"))] + [
        "response_len_mean", "reward_failed"]
    lines = ["| dataset | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name, m in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{m[k]:.0f}" if k in ("prompts", "reward_failed") else f"{m[k]:.4f}"
                                                 for k in keys) + " |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """``megatron-rl eval``'s work (its arguments: :mod:`megatron_rl.cli.eval`); returns the exit code."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        setup = resolve(args.target, args.overrides, args.model)
    except (ConfigError, ValueError) as e:
        print(f"megatron-rl eval: config error: {e}", file=sys.stderr)
        return 2
    try:
        results = evaluate(setup, args.step)
    except ConfigError as e:
        print(f"megatron-rl eval: config error: {e}", file=sys.stderr)
        return 2
    print(f"model: {setup.model}  (k={setup.eval.k}, {setup.eval.samples_per_prompt} samples per prompt, "
          f"reward {setup.reward.kind})")
    print(markdown_table(results))
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump({"model": setup.model, "k": setup.eval.k, "datasets": results}, f, indent=2)
    return 0
