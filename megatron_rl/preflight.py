"""Pre-flight: a run config and what it points at, checked before anything starts (so by ``--dry-run``).

The config package checks its own rules without importing the rest of the package (it loads no torch); the
checks here read files or need the data, model and training code, so they live above both. Every problem is
collected, the config's and these together, and all are raised in one :class:`~megatron_rl.config_io.ConfigError`,
each one line naming the file or field, the value and the fix:

* the token budget: the longest sequence must fit a micro-batch (the training code's padding rules);
* the outputs: checkpoint settings, and a ``logging.output_dir`` that already holds another run's checkpoints;
* prompt tables (``data``, ``eval.data``): readable, not empty, every row with the configured columns;
* model directories: ``config.json`` parses, every safetensors file has a readable header and the size it
  announces (a truncated download is named, not found by a failed tensor load);
* ``reward.custom_fn`` imports and has the function;
* the output directory and checkpoint root can be written;
* resuming: the ``latest`` pointer names a checkpoint, ``resume_step`` exists, and the checkpoint was trained
  from a model of this shape, with this LR schedule;
* ``rollout.urls`` of remote servers answer ``/health``, and honour ``sampling_seed`` when the run is seeded;
* once every path exists: vocabulary vs tokenizer, lengths vs context, model vs parallel sizes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import http.client
import json
import math
import os
import struct
import tempfile
import urllib.error
import urllib.request
from typing import List, Optional, Sequence

import torch
from transformers import AutoConfig, AutoTokenizer

from megatron_rl.config.checks import rule_problems, routing_fields
from megatron_rl.config.limits import limit_problems, model_config_problems
from megatron_rl.config.load import build_run_config, resolve_mapping
from megatron_rl.config.run import PrepareConfig, RunConfig
from megatron_rl.config_io import ConfigError, build
from megatron_rl.data.config import deferred_path_checks
from megatron_rl.data.loading import check_prompt_file
from megatron_rl.data.rewards.resolve import load_custom_fn
from megatron_rl.data.tiny_task import prepare_tiny_arithmetic
from megatron_rl.models.config import HFArch, check_divisibility
from megatron_rl.run_dir import output_problems
from megatron_rl.training.checkpoint import (
    CheckpointConfig,
    iter_name,
    latest_checkpoint,
    list_checkpoints,
    model_signature,
    signature_mismatch,
)
from megatron_rl.training.micro_batch import packed_lengths, stream_multiple


def load_run_config(recipe: Optional[str], overrides: Sequence[str] = (), *, prepare: bool = True,
                    check: bool = True) -> RunConfig:
    """Recipe + overrides -> a checked :class:`RunConfig` (raises :class:`~megatron_rl.config_io.ConfigError`
    listing every problem). ``prepare`` first builds generated assets the recipe names (``prepare.kind``);
    ``check=False`` only builds (each section still validates itself)."""
    mapping = resolve_mapping(recipe, overrides)
    if prepare:  # the data and model sections check that their paths exist: make generated assets first
        try:
            prep = build(PrepareConfig, mapping.get("prepare") or {}, "prepare")
            if prep.kind == "tiny_arithmetic":
                prepare_tiny_arithmetic(prep.dir, seed=prep.seed, model=prep.model)
        except (ConfigError, ValueError) as e:  # ValueError: e.g. the directory holds the other model's assets
            raise ConfigError(str(e)) from None
    # checked: a missing data file is listed with every other problem (check_files), not alone
    with deferred_path_checks() if check else contextlib.nullcontext():
        cfg = build_run_config(mapping)
    if check:
        check_run_config(cfg)
    return cfg


def check_run_config(cfg: RunConfig, *, files: bool = True) -> None:
    """Raise one ConfigError listing every problem. ``files=False`` skips what reads the model directory
    and tokenizer (checking a GPU recipe on a machine without its checkpoints)."""
    problems = rule_problems(cfg, files=files)
    # otherwise reported by the rules (an out-of-range length would overflow the budget's arithmetic)
    if cfg.parallel.world_size % cfg.parallel.model_parallel == 0 and not limit_problems(cfg):
        token_budget(cfg, problems)
    outputs(cfg, problems)
    if files:
        check_files(cfg, problems)  # data, model files, reward import, writable outputs, resume, remote servers
    if files and not problems:  # model-file checks only once the paths are known to exist
        try:
            model_files(cfg, problems, routing_fields(cfg))
        except Exception as e:  # noqa: BLE001 - transformers' error of a file we could not pre-check
            problems.append(f"model.hf_path={cfg.model.hf_path!r} / tokenizer {cfg.tokenizer_path!r} cannot be loaded "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); check the directory")
    if problems:
        raise ConfigError(problems)


def check_files(cfg: RunConfig, out: List[str]) -> None:
    for check in (_data, _models, _reward, _writable, _resume, _remote):
        check(cfg, out)


def _data(cfg: RunConfig, out: List[str]) -> None:
    evals = {"eval.data": cfg.eval.data} if cfg.eval.data is not None else {
        f"eval.datasets.{name}": d for name, d in cfg.eval.named_datasets.items()}
    for section, data in (("data", cfg.data), *evals.items()):
        try:
            check_prompt_file(data, section)
        except ValueError as e:
            out.append(str(e))


def safetensors_problem(path: str) -> Optional[str]:
    """Why a ``.safetensors`` file cannot be loaded (header unreadable, or shorter than its header says)."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size:
                raise ValueError(f"a header of {n} bytes in a {size}-byte file")
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as e:
        return f"{path} is not a readable safetensors file ({type(e).__name__}: {e}); download it again"
    if size < 8 + n + end:
        return f"{path} has {size} bytes but its header describes {8 + n + end} (truncated); download it again"
    return None


def _model_dir(path: Optional[str], field: str, out: List[str]) -> None:
    if path is None or not os.path.isdir(path):
        return  # reported by paths() below
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        out.append(f"{field}={path!r}: config.json cannot be read ({type(e).__name__}: {e}); restore the file")
        return
    bad = model_config_problems(field, path, config)
    if bad:
        out.extend(bad)
        return
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            out.append(f"{field}={path!r}: {index} cannot be read ({type(e).__name__}: {e})")
            return
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            out.append(f"{field}={path!r}: shard(s) {missing} named by model.safetensors.index.json are missing; "
                       "download them")
    for f in files:
        problem = safetensors_problem(f)
        if problem:
            out.append(f"{field}: {problem}")


def _models(cfg: RunConfig, out: List[str]) -> None:
    _model_dir(cfg.model.hf_path, "model.hf_path", out)
    ref = cfg.train.reference_model
    if ref is not None and ref.hf_path != cfg.model.hf_path:
        _model_dir(ref.hf_path, "warmup.teacher" if cfg.warmup.teacher else "train.reference_model.hf_path", out)


def _reward(cfg: RunConfig, out: List[str]) -> None:
    if cfg.reward.kind != "custom" or not cfg.reward.custom_fn:
        return
    target = cfg.reward.custom_fn.rsplit(":", 1)[0]
    if target.endswith(".py") and not os.path.isfile(target):
        return  # reported by paths() below
    try:
        load_custom_fn(cfg.reward.custom_fn)  # what the run does first: imports the module
    except ValueError as e:
        out.append(str(e))


def _writable(cfg: RunConfig, out: List[str]) -> None:
    for field, path in (("logging.output_dir", cfg.output_dir), ("checkpoint.root", cfg.checkpoint_root)):
        if os.path.exists(path) and not os.path.isdir(path):
            out.append(f"{field}={path!r} is a file, not a directory; choose a directory")
            return  # the checkpoint root usually lies inside: one message is enough
        existing = os.path.abspath(path)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        try:
            if not os.path.isdir(existing):
                raise NotADirectoryError(f"{existing!r} is a file")
            fd, probe = tempfile.mkstemp(dir=existing, prefix=".megatron_rl_write_check_")
            os.close(fd)
            os.remove(probe)
        except OSError as e:
            out.append(f"{field}={path!r} cannot be written ({type(e).__name__}: {e}); choose a writable directory")
            return  # the checkpoint root usually lies inside: one message is enough


def _resume(cfg: RunConfig, out: List[str]) -> None:
    if not cfg.resume:
        return
    root, steps = cfg.checkpoint_root, list_checkpoints(cfg.checkpoint_root)
    if cfg.resume_step is not None:
        path = os.path.join(root, iter_name(cfg.resume_step))
        if not os.path.isdir(path):
            out.append(f"resume_step={cfg.resume_step}: no checkpoint {iter_name(cfg.resume_step)} in {root} "
                       f"(checkpoints there: steps {steps}); pick one of them")
            return
    else:
        try:
            path = latest_checkpoint(root)
        except ValueError as e:
            out.append(f"resume=true: {e}; set resume_step to one of the checkpoints there (steps {steps}) or "
                       "remove the latest file")
            return
    if path is not None:
        _same_model(cfg, path, out)


def _same_model(cfg: RunConfig, path: str, out: List[str]) -> None:
    """The checkpoint's model shape (recorded since manifests exist) against ``model.hf_path``'s, and its LR
    schedule against ``optim``'s (the trainer refuses to continue another schedule)."""
    try:
        saved = torch.load(os.path.join(path, "common.pt"), map_location="cpu", weights_only=True)["trainer"]
        current = model_signature(HFArch.from_hf(AutoConfig.from_pretrained(cfg.model.hf_path)))
    except Exception:  # noqa: BLE001 - a damaged checkpoint is the run's to skip (with a warning); files: reported
        return
    mismatch = signature_mismatch(saved.get("model_shape"), current)
    if mismatch:
        out.append(f"resume=true: {path} was trained from another model than model.hf_path={cfg.model.hf_path!r} "
                   f"({mismatch}); resume with that model, or start a new run (another logging.output_dir, or "
                   "overwrite=true)")
    schedule = (saved.get("schedule") or {}).get("config")
    now = dataclasses.asdict(cfg.optim.schedule)
    changed = [f"{k} {schedule[k]!r} (checkpoint) vs {now[k]!r} (now)" for k in now if schedule and k in schedule
               and schedule[k] != now[k]]
    if changed:
        out.append(f"resume=true: {path} continues another LR schedule ({', '.join(changed)}; optim.lr is the "
                   "schedule's lr); resume with the optim settings it was trained with, or start a new run")


def _remote(cfg: RunConfig, out: List[str]) -> None:
    if cfg.rollout.engine != "remote":
        return
    for i, url in enumerate(cfg.rollout.urls):
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as r:
                r.read()
        except urllib.error.HTTPError as e:
            out.append(f"rollout.urls[{i}]={url!r} answers /health with HTTP {e.code}: not a healthy SGLang server; "
                       "check the URL and the server's log")
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            out.append(f"rollout.urls[{i}]={url!r}: no SGLang server answers there ({reason}); start it, or fix "
                       "the URL (the port may belong to another program)")
        else:
            if cfg.rollout.deterministic_inference:
                _remote_deterministic(i, url, out)


def _remote_deterministic(i: int, url: str, out: List[str]) -> None:
    """Without --enable-deterministic-inference SGLang silently ignores sampling_seed (the servers we launch get
    the flag from us); SGLang's /server_info reports its server args, this flag among them."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/server_info", timeout=5) as r:
            flag = json.loads(r.read()).get("enable_deterministic_inference")
        why = f"its /server_info has enable_deterministic_inference={flag}"
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError, AttributeError) as e:
        flag, why = None, f"its /server_info could not be read ({getattr(e, 'reason', e)})"
    if flag is not True:
        out.append(f"rollout.urls[{i}]={url!r} must honour sampling_seed (rollout.seeded / "
                   f"rollout.deterministic_inference), but {why}; start the server with "
                   "--enable-deterministic-inference, or set rollout.seeded=false and "
                   "rollout.deterministic_inference=false")


def token_budget(cfg: RunConfig, out: List[str]) -> None:
    """The longest sequence a run can produce must fit a micro-batch's token budget (per CP rank, after the
    padding CP and sequence parallelism need)."""
    p, t = cfg.parallel, cfg.train
    longest = cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_new_tokens
    sp = p.tp > 1 if cfg.model.sequence_parallel is None else cfg.model.sequence_parallel
    multiple = stream_multiple(math.lcm(t.pad_to_multiple, (p.tp if sp else 1) * p.cp), p.cp)
    stream = -(-int(packed_lengths(torch.tensor([longest]), p.cp)[0]) // multiple) * multiple
    for name in ("max_tokens_per_micro_batch", "forward_max_tokens_per_micro_batch"):
        cap = getattr(t, name)
        if cap and stream > cap * p.cp:
            out.append(f"a sequence can reach data.max_prompt_tokens + rollout.sampling.max_new_tokens = {longest} "
                       f"tokens ({stream} once padded for parallel.cp={p.cp} / tp), more than train.{name}={cap} x "
                       f"parallel.cp={p.cp} = {cap * p.cp}; raise train.{name} to >= {-(-stream // p.cp)} or "
                       "parallel.cp (the budget is per CP rank)")


def outputs(cfg: RunConfig, out: List[str]) -> None:
    c = cfg.checkpoint
    try:
        CheckpointConfig(root=cfg.checkpoint_root, keep_last=c.keep_last, save_optimizer=c.save_optimizer,
                         optimizer_format=c.optimizer_format)
    except ValueError as e:
        out.append(str(e))
    if not cfg.resume and not cfg.overwrite and list_checkpoints(cfg.checkpoint_root):
        out.append(f"{cfg.checkpoint_root} already holds checkpoints of a run: pass resume=true to continue it, "
                   f"overwrite=true to start over (deletes them), or another logging.output_dir")
    out.extend(output_problems(cfg))  # another run's lock, metrics.jsonl, an unresumable checkpoint root


def model_files(cfg: RunConfig, out: List[str], routing: List[str]) -> None:
    """Vocabulary vs tokenizer, lengths vs context, model vs parallel sizes (reads config.json + tokenizer);
    ``routing``: the routing-replay switches that are on (they need an MoE model)."""
    arch = HFArch.from_hf(AutoConfig.from_pretrained(cfg.model.hf_path))
    tok = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
    if len(tok) > arch.vocab_size:
        out.append(f"the tokenizer at {cfg.tokenizer_path!r} has {len(tok)} tokens but model.hf_path's vocab_size is "
                   f"{arch.vocab_size}: token ids would fall outside the embedding; use the model's own tokenizer")
    if tok.eos_token_id is None:
        out.append(f"the tokenizer at {cfg.tokenizer_path!r} has no eos_token: responses could not stop")
    ref = cfg.train.reference_model
    if ref is not None:
        ref_arch = HFArch.from_hf(AutoConfig.from_pretrained(ref.hf_path))
        if ref_arch.vocab_size != arch.vocab_size:
            out.append(f"the reference/teacher model {ref.hf_path!r} has vocab_size {ref_arch.vocab_size}, the policy "
                       f"{arch.vocab_size}: the per-token KL needs the same vocabulary")
    longest = cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_new_tokens
    if longest > arch.max_position_embeddings:
        out.append(f"data.max_prompt_tokens + rollout.sampling.max_new_tokens = {cfg.data.max_prompt_tokens} + "
                   f"{cfg.rollout.sampling.max_new_tokens} = {longest} exceeds the model's max_position_embeddings="
                   f"{arch.max_position_embeddings}; lower one of them")
    try:
        check_divisibility(arch, cfg.parallel.layout)
    except ValueError as e:
        out.append(f"parallel (tp={cfg.parallel.tp}, pp={cfg.parallel.pp}, ep={cfg.parallel.ep}) does not fit "
                   f"model.hf_path: {e}")
    if routing and not arch.is_moe:
        out.append(f"{' and '.join(f + '=true' for f in routing)} but model.hf_path={cfg.model.hf_path!r} is a dense "
                   f"{arch.model_type!r} model (no experts to route); set {' and '.join(routing)} to false, or use an "
                   "MoE model (e.g. the tiny recipe's prepare.model=qwen3_moe)")
