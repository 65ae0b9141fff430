#!/usr/bin/env python
"""Benchmark: one GRPO step end to end -- ours (megatron_rl.orchestration.driver.train) vs TRL's GRPOTrainer.

The same work on both sides, each in a fresh process with the same torch thread count:
  model     a random Qwen3 (sizes below; untied lm_head, fp32), saved once with a local word-level tokenizer
  prompts   16 prompts of --prompt-len tokens ("w123 w77 ..." words, one token each, no BOS), 8 completions
            each (GRPO groups), --new-tokens (32) new tokens each, temperature 1, no top-k/top-p
  reward    ``reward_fn`` below (fraction of even word ids in the completion): trivial, non-degenerate
  loss      GRPO advantages (group mean / std), PPO-clip (eps 0.2), token-mean; beta = 0 (no reference model);
            one optimizer step per batch (AdamW lr 1e-5, clip 1.0), micro-batches of --micro-batch sequences
  lengths   every completion is exactly --new-tokens long on both sides: the EOS token can never be sampled.
            Neither side can be told to ignore EOS (our RolloutPhase always stops on the tokenizer's EOS; TRL's
            ``min_new_tokens`` would index the logits), so the model does it: hidden dimension 0 of the
            residual stream is a constant 1 (embedding column 0 = 1, no attention / MLP output writes it), no
            lm_head row but EOS's reads it, and EOS's row is -1e4 * e_0: its logit is -1e4 * g_0 / rms(x) << 0
            at every position. Checked at run time (ours: rollout/response_len_mean; TRL:
            completions/mean_length) -- a bench whose lengths differ fails.

Sizes: small = 4 layers, hidden 256 (4 heads x 64, 2 KV heads, FFN 768); large = 8 layers, hidden 512 (8 x 64,
4 KV heads, FFN 1536); vocabulary --vocab (8192), untied lm_head; HF default init.

Ours: a RunConfig built here (TP=1, world_size=1, one colocated embedded engine behind its HTTP server, Ray;
torch threads --threads in each worker), policy mode ``bypass`` (old log-probs := the rollout's, as TRL with
num_iterations=1: no extra forward), no eval, no checkpoint (the run's final checkpoint falls on the unmeasured
last step); everything else at its default, the post-sync probe check included. ``--ours-decoupled`` adds a row
with the default ``decoupled`` mode (one log-prob forward of the batch on the trainer: the "log-probs" column).
TRL: GRPOTrainer (transformers ``generate``, no vLLM, CPU, fp32), num_generations=8, per_device_train_batch_size
= --micro-batch with gradient accumulation so that one optimizer step = 16 x 8 completions, generated at once.

Timing: 1 warm-up step, --steps timed steps (median), 1 trailing step not timed; --repeats runs each side again
(interleaved, fresh processes) and reports the median of the runs. Ours: the run's own ``time/<phase>``
metrics: rollout (generation over HTTP), reward, logprobs, train, weight_sync (transfer + probe check); "other"
is the rest of ``time/step`` (engine memory release/resume, advantages, batching, logging). TRL: on_step_begin
to the next on_step_begin (the whole optimizer step, generation included); "rollout" is ``_generate``
(transformers.generate + decode), "reward" is ``_calculate_rewards``, "other" the rest of
``_generate_and_score_completions`` (padding, advantages); "train" is the step minus
``_generate_and_score_completions``. "speed vs TRL" = TRL step s / this row's step s (> 1: faster than TRL).
tokens/s: completion tok/s = prompts x group x new tokens / step s; total tok/s counts prompt tokens too
(prompts x group x (prompt len + new tokens)) / step s. The load average before/after each run is printed
(the numbers are only as good as the machine was quiet).

MFU (both sides alike): the step's model FLOPs (megatron_rl.perf.ModelFlops: 2 x matmul parameters per token
plus causal attention over each sequence) -- one forward over every generated sequence (prompt + completion),
forward + backward (3x) over the trained batch, plus one forward for ours-decoupled's log-prob pass -- over
step s x the device peak: on CPU the fp32 matmul rate of --threads threads, measured by
megatron_rl.perf.device_peak_flops after the runs. One device per side (ours: one trainer with a colocated
engine). Ours' own per-step ``perf/mfu`` (same definition, the trainer's measured peak) is kept in the JSON as
a check.

Multi-node (--ray-nodes N, ours only): a local ``ray.cluster_utils.Cluster`` of N nodes with --cpus-per-node
logical CPUs each (or the cluster at --address), world_size N (data parallel), one colocated engine per node:
the run places trainer i and engine i in bundle i of its placement group, so one of each per node. Per node:
its actors (from the placement group's bundle -> node table), the completion tokens its engine generated per
step (counted on the driver's HTTP clients) and its trainer's share of the batch (an equal split over DP).

  python tools/bench_rl_step.py                           # small and large, both sides: ~12 min on 2 cores
  python tools/bench_rl_step.py --sizes small --steps 2
  python tools/bench_rl_step.py --steps 3 --repeats 2 --ours-decoupled   # the reported table (~35 min)
  python tools/bench_rl_step.py --sizes small --ray-nodes 2 --sides ours   # 2 local Ray nodes, per-node figures
  python tools/bench_rl_step.py --address HOST:PORT --ray-nodes 2 --sides ours  # an existing `ray start` cluster
  python tools/bench_rl_step.py --dry-run                 # tiny model, ours only, 1 timed step (~35 s)
TRL is installed only for this bench: ``pip install -e '.[bench]'``. Prints a markdown table; writes JSON to
--out (default bench_results/bench_rl_step.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
SIZES = {
    "small": dict(layers=4, hidden=256),
    "large": dict(layers=8, hidden=512),
    "tiny": dict(layers=2, hidden=64),  # --dry-run
}
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
OUR_PHASES = ("rollout", "reward", "engine_memory", "logprobs", "advantages", "train", "weight_sync")


# ---- the shared reward ---------------------------------------------------------------------------------------
def reward_fn(response: str, label: Any = None, **_: Any) -> float:
    """Fraction of the completion's words with an even id ("w12" -> 12): cheap, varies within a group."""
    words = [w for w in response.split() if w[1:].isdigit()]
    return sum(int(w[1:]) % 2 == 0 for w in words) / max(1, len(words))


def trl_reward(completions: List[str], **_: Any) -> List[float]:
    return [reward_fn(c) for c in completions]


# ---- assets ----------------------------------------------------------------------------------------------------
def make_tokenizer(path: str, vocab: int):
    """Word-level tokenizer: <pad> <bos> <eos> <unk> then "w4" .. "w{vocab-1}", split on whitespace, no BOS added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = ["<pad>", "<bos>", "<eos>", "<unk>"] + [f"w{i}" for i in range(4, vocab)]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    backend.add_special_tokens(tokens[:4])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                  unk_token="<unk>", model_max_length=4096)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    tok.save_pretrained(path)
    return tok


def make_model(path: str, layers: int, hidden: int, vocab: int, seed: int = 0) -> str:
    """A random Qwen3 that can never sample EOS (see the module docstring), saved with its tokenizer."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads = max(1, hidden // 64)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64,
                      max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=PAD_ID,
                      bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).float()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0].zero_()
            layer.mlp.down_proj.weight[0].zero_()
        head = model.lm_head.weight
        head[:, 0] = 0.0
        head[EOS_ID] = 0.0
        head[EOS_ID, 0] = -1e4
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    model.save_pretrained(path)
    make_tokenizer(path, vocab)
    return path


def make_prompts(path: str, n: int, length: int, vocab: int, seed: int = 0) -> List[Dict[str, str]]:
    import random

    rng = random.Random(seed)
    rows = [{"prompt": " ".join(f"w{rng.randrange(4, vocab)}" for _ in range(length)), "answer": "w4"}
            for _ in range(n)]
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return rows


# ---- ours --------------------------------------------------------------------------------------------------------
def ours_config(spec: Dict[str, Any]):
    from megatron_rl.config import build_run_config

    nodes = spec.get("ray_nodes") or 1
    mapping = {
        "seed": 0,
        "steps": spec["total_steps"],
        "overwrite": True,
        "model": {"hf_path": spec["model"]},
        "data": {"path": spec["data"], "max_prompt_tokens": spec["prompt_len"], "label_field": "answer"},
        "reward": {"kind": "custom", "custom_fn": f"{Path(__file__).resolve()}:reward_fn", "in_process": True},
        "parallel": {"world_size": nodes, "tp": 1},
        "rollout": {
            "engine": "embedded", "num_engines": nodes, "placement": "colocated",
            "n_samples_per_prompt": spec["group"], "prompts_per_step": spec["prompts"], "dynamic_sampling": False,
            "sampling": {"temperature": 1.0, "max_new_tokens": spec["new_tokens"]},
            "weight_sync": {"progress": False},
            "host": "0.0.0.0" if spec.get("address") else "127.0.0.1",
        },
        "train": {"micro_batch_size": spec["micro_batch"], "objective": {
            "policy": {"loss": "ppo_clip", "mode": spec["mode"], "clip_eps_low": 0.2, "clip_eps_high": 0.2},
            "aggregation": {"mode": "token_mean"}}},
        "advantage": {"estimator": "grpo"},
        "optim": {"lr": 1e-5, "clip_grad": 1.0},
        "eval": {"interval": 0},
        "checkpoint": {"interval": 0, "save_hf": False, "save_optimizer": False},
        "logging": {"output_dir": spec["out_dir"], "tensorboard": False, "progress": False, "print_samples": 0},
        "cluster": {"cpus_per_trainer": spec.get("cpus_per_trainer", 1), "threads_per_worker": spec["threads"],
                    "num_cpus": None if spec.get("ray_nodes") else max(2, spec["threads"]),
                    "address": spec.get("address")},
    }
    return build_run_config(mapping)


class _Recorder:
    """Per-engine completion tokens (the driver's HTTP clients, in engine order) and where actors were placed."""

    def __init__(self) -> None:
        self.urls: List[str] = []
        self.tokens: Dict[str, int] = {}
        self.placement = None

    def install(self) -> None:
        import threading

        from megatron_rl.orchestration import placement
        from megatron_rl.rollout.client import http_client

        rec, lock = self, threading.Lock()
        orig_init, orig_gen, orig_place = (http_client.SGLangClient.__init__, http_client.SGLangClient.generate_one,
                                           placement.place)

        def init(client, url, *a, **kw):
            orig_init(client, url, *a, **kw)
            rec.urls.append(client.url if hasattr(client, "url") else url)

        def generate_one(client, req):
            out = orig_gen(client, req)
            key = client.url if hasattr(client, "url") else "?"
            with lock:
                rec.tokens[key] = rec.tokens.get(key, 0) + sum(len(s.response_ids) for s in out)
            return out

        def place(*a, **kw):
            rec.placement = orig_place(*a, **kw)
            return rec.placement

        http_client.SGLangClient.__init__ = init
        http_client.SGLangClient.generate_one = generate_one
        placement.place = place

    def actor_nodes(self) -> Dict[str, str]:
        """{"trainer 0": node id, "engine 0": node id, ...} from the placement groups' bundle -> node table."""
        from ray.util import placement_group_table

        p, out = self.placement, {}
        if p is None or not p.groups:
            return out
        trainer_nodes = placement_group_table(p.groups[0])["bundles_to_node_id"]
        for i in range(len(p.trainers)):
            out[f"trainer {i}"] = trainer_nodes[i]
        engine_nodes = trainer_nodes if len(p.groups) == 1 else placement_group_table(p.groups[1])["bundles_to_node_id"]
        for i in range(len(p.engines)):
            out[f"engine {i}"] = engine_nodes[i]
        return out


def _ours_worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    import ray

    from megatron_rl.orchestration import driver

    cluster = None
    rec = _Recorder()
    rec.install()
    node_tags: Dict[str, str] = {}
    env = {"OMP_NUM_THREADS": str(spec["threads"]), "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"}
    if spec.get("ray_nodes") and not spec.get("address"):
        from ray.cluster_utils import Cluster

        node_args = dict(num_cpus=spec["cpus_per_node"], object_store_memory=128 * 1024**2)
        cluster = Cluster(initialize_head=True, head_node_args=dict(node_args, resources={"bench_node_0": 1},
                                                                    include_dashboard=False))
        for k in range(1, spec["ray_nodes"]):
            cluster.add_node(**node_args, resources={f"bench_node_{k}": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="warning", runtime_env={"env_vars": env})
    elif spec.get("address"):
        ray.init(address=spec["address"], logging_level="warning", runtime_env={"env_vars": env})
    if ray.is_initialized():
        # one bundle (a trainer + its colocated engine) fills the smallest node: the PACK placement group then
        # cannot put two on one node, so the N trainers land on N nodes
        spec = dict(spec, cpus_per_trainer=min(n["Resources"].get("CPU", 1.0) for n in ray.nodes() if n["Alive"]))
    try:
        cfg = ours_config(spec)
        if ray.is_initialized():  # we hold the connection: keep the placement groups readable during the run
            import threading

            done = threading.Event()
            result: Dict[str, Any] = {}

            def run() -> None:
                try:
                    result["history"] = driver.train(cfg)
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    result["error"] = e
                finally:
                    done.set()

            t = threading.Thread(target=run, daemon=True)
            t.start()
            while not done.wait(0.5):
                if rec.placement is not None and not node_tags:
                    try:
                        node_tags = rec.actor_nodes()
                    except Exception:  # noqa: BLE001 - placement groups not ready yet
                        node_tags = {}
            if "error" in result:
                raise result["error"]
            history = result["history"]
            nodes = {n["NodeID"]: ([k for k in n["Resources"] if k.startswith("bench_node_")] or
                                   [f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})"])[0]
                     for n in ray.nodes() if n["Alive"]}
        else:
            history = driver.train(cfg)
            nodes = {}
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    steps = [h for h in history if "time/step" in h and "train/tokens" in h]
    return {"history": steps, "actor_nodes": node_tags, "node_names": nodes, "engine_urls": rec.urls,
            "engine_tokens": rec.tokens}


def summarize_ours(res: Dict[str, Any], spec: Dict[str, Any]) -> Dict[str, Any]:
    hist = res["history"]
    timed = hist[spec["warmup"]: spec["warmup"] + spec["steps"]]
    lens = [h["rollout/response_len_mean"] for h in hist]
    if any(abs(x - spec["new_tokens"]) > 1e-9 for x in lens):
        raise RuntimeError(f"ours: completions are not all {spec['new_tokens']} tokens: mean lengths {lens}")
    med = lambda key: statistics.median(h.get(key, 0.0) for h in timed)  # noqa: E731
    phases = {p: med(f"time/{p}") for p in OUR_PHASES}
    step = med("time/step")
    phases["other"] = max(0.0, step - sum(phases.values()))
    out = {"phases": phases, "step_s": step, "steps_s": [h["time/step"] for h in timed],
           "rollout_tok_s": med("perf/rollout_tokens_per_s"), "train_tok_s": med("perf/train_tokens_per_s"),
           "logged_mfu": med("perf/mfu"), "logged_tokens_per_s_per_gpu": med("perf/tokens_per_s_per_gpu"),
           "startup_s": hist[0].get("time/startup") if hist else None, "reward_mean": med("rollout/reward_mean")}
    if res.get("actor_nodes"):
        out["per_node"] = per_node(res, spec, step, phases["rollout"])
    return out


def per_node(res: Dict[str, Any], spec: Dict[str, Any], step_s: float, rollout_s: float) -> List[Dict[str, Any]]:
    """Actors per node, the completion tokens its engines generated (all steps, per step), its trainers' share."""
    names, actors = res["node_names"], res["actor_nodes"]
    steps = max(1, len(res["history"]))
    engine_tokens = {i: res["engine_tokens"].get(u, 0) / steps for i, u in enumerate(res["engine_urls"])}
    trainers = sum(1 for a in actors if a.startswith("trainer"))
    batch_tokens = spec["prompts"] * spec["group"] * (spec["prompt_len"] + spec["new_tokens"])
    rows = []
    for node in sorted(set(actors.values()), key=lambda n: names.get(n, n)):
        here = sorted(a for a, n in actors.items() if n == node)
        gen = sum(engine_tokens.get(int(a.split()[1]), 0) for a in here if a.startswith("engine"))
        n_tr = sum(a.startswith("trainer") for a in here)
        rows.append({"node": names.get(node, node[:8]), "node_id": node, "actors": here,
                     "completion_tokens_per_step": gen, "engine_tok_s": gen / rollout_s if rollout_s else 0.0,
                     "completion_tok_s": gen / step_s,
                     "train_tokens_per_step": batch_tokens * n_tr / max(1, trainers),
                     "train_tok_s": batch_tokens * n_tr / max(1, trainers) / step_s})
    return rows


# ---- TRL -----------------------------------------------------------------------------------------------------------
def _trl_worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    import trl
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(spec["threads"])
    rows = [json.loads(line) for line in open(spec["data"])]
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    batch = spec["prompts"] * spec["group"]
    accum = batch // spec["micro_batch"]
    args = GRPOConfig(
        output_dir=spec["out_dir"], per_device_train_batch_size=spec["micro_batch"], gradient_accumulation_steps=accum,
        steps_per_generation=accum, num_generations=spec["group"], max_completion_length=spec["new_tokens"],
        max_steps=spec["total_steps"], learning_rate=1e-5, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        temperature=1.0, top_p=1.0, top_k=0, use_vllm=False, use_cpu=True, bf16=False, fp16=False,
        logging_steps=1, report_to=[], save_strategy="no", dataloader_num_workers=0, seed=0,
        disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=[trl_reward], args=args, processing_class=tok,
                          train_dataset=Dataset.from_list(rows))
    times: Dict[str, List[float]] = {"begin": [], "end": []}
    sections: Dict[str, List[float]] = {"generate": [], "reward": [], "gen_and_score": []}
    logs: List[Dict[str, float]] = []
    logs_seen = logs  # on_log's own argument is called `logs`

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                sections[name].append(time.perf_counter() - t)
        return wrapper

    trainer._generate = timed("generate", trainer._generate)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer._generate_and_score_completions = timed("gen_and_score", trainer._generate_and_score_completions)

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            times["begin"].append(time.perf_counter())

        def on_step_end(self, *a, **kw):
            times["end"].append(time.perf_counter())

        def on_log(self, args_, state, control, logs=None, **kw):
            if logs:
                logs_seen.append({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    trainer.add_callback(Clock())
    trainer.train()
    return {"times": times, "sections": sections, "logs": logs, "trl": trl.__version__,
            "torch_threads": torch.get_num_threads(),
            "per_device_train_batch_size": spec["micro_batch"], "gradient_accumulation_steps": accum}


def summarize_trl(res: Dict[str, Any], spec: Dict[str, Any]) -> Dict[str, Any]:
    begin, end, sec = res["times"]["begin"], res["times"]["end"], res["sections"]
    n = len(end)
    if len(sec["gen_and_score"]) != n:
        raise RuntimeError(f"TRL: {len(sec['gen_and_score'])} generations for {n} optimizer steps (expected one each)")
    lengths = [g["completions/mean_length"] for g in res["logs"] if "completions/mean_length" in g]
    if not lengths or any(abs(x - spec["new_tokens"]) > 1e-9 for x in lengths):
        raise RuntimeError(f"TRL: completions are not all {spec['new_tokens']} tokens: mean lengths {lengths}")
    idx = list(range(spec["warmup"], spec["warmup"] + spec["steps"]))
    step = [(begin[i + 1] if i + 1 < len(begin) else end[i]) - begin[i] for i in idx]
    med = lambda xs: statistics.median(xs[i] for i in idx)  # noqa: E731
    gen, rew, gs = med(sec["generate"]), med(sec["reward"]), med(sec["gen_and_score"])
    train = statistics.median(s - sec["gen_and_score"][i] for s, i in zip(step, idx))
    phases = {"rollout": gen, "reward": rew, "train": train, "other": max(0.0, gs - gen - rew)}
    rewards = [g["reward"] for g in res["logs"] if "reward" in g]
    return {"phases": phases, "step_s": statistics.median(step), "steps_s": step, "trl": res["trl"],
            "rollout_tok_s": spec["prompts"] * spec["group"] * spec["new_tokens"] / gen,
            "reward_mean": statistics.median(rewards) if rewards else None,
            "gradient_accumulation_steps": res["gradient_accumulation_steps"]}


# ---- driver --------------------------------------------------------------------------------------------------------
def combine(reps: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Repeats of one run: the median of each figure (each repeat's figures are medians over its steps)."""
    if len(reps) == 1:
        return reps[0]
    out = dict(reps[0])
    out["phases"] = {k: statistics.median(r["phases"].get(k, 0.0) for r in reps) for k in reps[0]["phases"]}
    for key in ("step_s", "rollout_tok_s", "train_tok_s"):
        if reps[0].get(key) is not None:
            out[key] = statistics.median(r[key] for r in reps)
    out["load_before"] = " | ".join(r["load_before"] for r in reps)
    out["load_after"] = " | ".join(r["load_after"] for r in reps)
    out["repeats"] = reps
    return out


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def run_side(side: str, spec: Dict[str, Any], tmp: str, timeout_s: float) -> Dict[str, Any]:
    """One side in a fresh interpreter (``--worker``); returns its raw result."""
    spec_path, out_path = os.path.join(tmp, f"{side}.spec.json"), os.path.join(tmp, f"{side}.result.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), TOKENIZERS_PARALLELISM="false",
               RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if spec.get("ray_nodes") and not spec.get("address"):
        env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rb-", dir="/tmp")  # short socket paths, a private cluster file
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--spec", spec_path, "--result", out_path]
    load_before = _load()
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, timeout=timeout_s, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0 or not os.path.exists(out_path):
        raise RuntimeError(f"{side} worker failed (exit {proc.returncode}):\n{proc.stdout[-6000:]}")
    with open(out_path) as f:
        res = json.load(f)
    res["wall_s"], res["load_before"], res["load_after"] = wall, load_before, _load()
    return res


def step_flops(model_dir: str, args, decoupled: bool) -> float:
    """Model FLOPs of one step (see the module docstring): every sequence is prompt_len + new_tokens long."""
    from transformers import AutoConfig

    from megatron_rl.models.config import HFArch
    from megatron_rl.perf import ModelFlops

    flops = ModelFlops.from_arch(HFArch.from_hf(AutoConfig.from_pretrained(model_dir)))
    n, length = args.prompts * args.group, args.prompt_len + args.new_tokens
    return (1 + 3 + decoupled) * flops.forward(n * length, n * length ** 2)


def cpu_peak_flops(threads: int) -> float:
    import torch

    from megatron_rl.perf import device_peak_flops

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return float(device_peak_flops(torch.float32, torch.device("cpu"))["peak_flops"])
    finally:
        torch.set_num_threads(before)


def _fmt_row(label: str, r: Dict[str, Any], tokens: Dict[str, int], ref: Optional[float]) -> str:
    p = r["phases"]
    cols = [p.get(k) for k in ("rollout", "reward", "logprobs", "train", "weight_sync")]
    other = p.get("other", 0.0) + p.get("engine_memory", 0.0) + p.get("advantages", 0.0)
    cells = ["-" if v is None else f"{v:.2f}" for v in cols] + [f"{other:.2f}"]
    ratio = "-" if ref is None else f"{ref / r['step_s']:.2f}x"
    mfu = "-" if r.get("mfu") is None else f"{100 * r['mfu']:.1f} %"
    return (f"| {label} | " + " | ".join(cells) + f" | **{r['step_s']:.2f}** | "
            f"{tokens['completion'] / r['step_s']:.0f} | {tokens['total'] / r['step_s']:.0f} | {mfu} | {ratio} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="small,large", help=f"comma list of {sorted(SIZES)}")
    ap.add_argument("--sides", default="ours,trl", help="comma list of ours, trl")
    ap.add_argument("--ours-decoupled", action="store_true", help="also run ours with policy mode 'decoupled'")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--micro-batch", type=int, default=32, help="sequences per forward/backward, both sides")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per process, both sides")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (median) after one warm-up step")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1,
                    help="run each side this many times, interleaved (fresh processes); figures are medians")
    ap.add_argument("--ray-nodes", type=int, default=0,
                    help="ours on N Ray nodes (a local ray.cluster_utils.Cluster unless --address): world_size N "
                         "(data parallel), one colocated engine per node; per-node figures")
    ap.add_argument("--address", default=None, help="an existing Ray cluster ('auto' or host:port) for --ray-nodes")
    ap.add_argument("--cpus-per-node", type=float, default=1.0, help="logical CPUs of each local Ray node")
    ap.add_argument("--dry-run", action="store_true", help="tiny model, ours only, 1 timed step (a smoke test)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per side")
    ap.add_argument("--out", default="bench_results/bench_rl_step.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        with open(args.spec) as f:
            spec = json.load(f)
        res = _ours_worker(spec) if args.worker == "ours" else _trl_worker(spec)
        with open(args.result, "w") as f:
            json.dump(res, f)
        return

    if args.dry_run:
        args.sizes, args.sides, args.steps, args.vocab, args.prompts = "tiny", "ours", 1, 256, 4
        args.new_tokens, args.prompt_len, args.micro_batch, args.ours_decoupled = 8, 8, 16, False
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if args.ray_nodes and "trl" in sides:
        print("note: TRL runs single-process; --ray-nodes applies to ours only", file=sys.stderr)
    if (args.prompts * args.group) % args.micro_batch:
        ap.error(f"--micro-batch {args.micro_batch} must divide prompts x group = {args.prompts * args.group}")
    runs = []
    for s in sides:
        if s == "ours":
            runs.append(("ours", "bypass"))
            if args.ours_decoupled:
                runs.append(("ours", "decoupled"))
        elif s == "trl":
            runs.append(("trl", None))
        else:
            ap.error(f"unknown side {s!r}")
    if any(side == "trl" for side, _ in runs):
        import importlib.util

        if importlib.util.find_spec("trl") is None:
            ap.error("TRL is not installed (it is only for this bench): pip install -e '.[bench]', or --sides ours")
    tokens = {"completion": args.prompts * args.group * args.new_tokens,
              "total": args.prompts * args.group * (args.prompt_len + args.new_tokens)}
    results: Dict[str, Any] = {}
    flops_by_size: Dict[str, Dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_rl_") as tmp:
        for size in [s.strip() for s in args.sizes.split(",") if s.strip()]:
            dims = SIZES[size]
            model = make_model(os.path.join(tmp, f"model_{size}"), dims["layers"], dims["hidden"], args.vocab)
            data = os.path.join(tmp, "prompts.jsonl")
            make_prompts(data, args.prompts, args.prompt_len, args.vocab)
            flops_by_size[size] = {n: step_flops(model, args, n == "ours-decoupled")
                                   for n in ("ours", "ours-decoupled", "trl")}
            for rep, (side, mode) in [(r, x) for r in range(args.repeats) for x in runs]:  # interleaved
                name = side if mode in (None, "bypass") else f"ours-{mode}"
                spec = dict(model=model, data=data, prompts=args.prompts, group=args.group,
                            new_tokens=args.new_tokens, prompt_len=args.prompt_len, micro_batch=args.micro_batch,
                            threads=args.threads, warmup=args.warmup, steps=args.steps,
                            total_steps=args.warmup + args.steps + 1, mode=mode or "bypass",
                            out_dir=os.path.join(tmp, f"run_{size}_{name}"),
                            ray_nodes=args.ray_nodes if side == "ours" else 0, address=args.address,
                            cpus_per_node=args.cpus_per_node)
                if side == "ours" and args.ray_nodes:
                    spec["threads"] = max(1, args.threads // args.ray_nodes) if not args.address else args.threads
                print(f"[{size}] {name} (repeat {rep + 1}/{args.repeats}) ... (load {_load()})", file=sys.stderr,
                      flush=True)
                raw = run_side(side, spec, tmp, args.timeout)
                summary = summarize_ours(raw, spec) if side == "ours" else summarize_trl(raw, spec)
                summary.update(load_before=raw["load_before"], load_after=raw["load_after"], wall_s=raw["wall_s"])
                results.setdefault(size, {}).setdefault(name, []).append(summary)
                print(f"  step {summary['step_s']:.2f} s, phases "
                      f"{ {k: round(v, 3) for k, v in summary['phases'].items()} } "
                      f"(load {raw['load_before']} -> {raw['load_after']})", file=sys.stderr, flush=True)
    results = {size: {name: combine(reps) for name, reps in rows.items()} for size, rows in results.items()}
    peak = cpu_peak_flops(args.threads)
    for size, rows in results.items():
        for name, r in rows.items():
            r["model_flops_per_step"] = flops_by_size[size][name]
            r["mfu"] = r["model_flops_per_step"] / (r["step_s"] * peak)

    print(f"\nGRPO step: {args.prompts} prompts x {args.group} completions, prompt {args.prompt_len} + "
          f"{args.new_tokens} new tokens (every completion full length), vocab {args.vocab}, micro-batch "
          f"{args.micro_batch}, fp32, {args.threads} torch threads per process, {os.cpu_count()} cores"
          + (f", ours on {args.ray_nodes} Ray nodes" if args.ray_nodes else "") + "\n")
    print("| size | run | rollout s | reward s | log-probs s | train s | weight sync s | other s | step s | "
          "completion tok/s | total tok/s | MFU | speed vs TRL |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size, rows in results.items():
        ref = rows.get("trl", {}).get("step_s")
        d = SIZES[size]
        for name, r in rows.items():
            print(_fmt_row(f"{size} ({d['layers']}x{d['hidden']}) | {name}", r, tokens, ref))
    print("\nload (1/5/15 min) before -> after each run: " + "; ".join(
        f"{size} {name}: {r['load_before']} -> {r['load_after']}" for size, rows in results.items()
        for name, r in rows.items()))
    for size, rows in results.items():
        for name, r in rows.items():
            for node in r.get("per_node", []):
                print(f"  {size} {name} node {node['node']}: {', '.join(node['actors'])}; "
                      f"{node['completion_tokens_per_step']:.0f} completion tokens/step "
                      f"({node['completion_tok_s']:.0f} tok/s of the step, engine {node['engine_tok_s']:.0f} tok/s "
                      f"while generating), trains {node['train_tokens_per_step']:.0f} tokens/step "
                      f"({node['train_tok_s']:.0f} tok/s of the step)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import torch

    print(f"MFU: model FLOPs per step / (step s x {peak / 1e9:.1f} GFLOP/s, the fp32 matmul peak of {args.threads} "
          "thread(s) measured here)")
    out.write_text(json.dumps({"args": vars(args), "tokens_per_step": tokens, "cores": os.cpu_count(),
                               "peak_flops": peak,
                               "torch": torch.__version__, "results": results}, indent=2))


if __name__ == "__main__":
    main()
