"""One benchmark run: the recipe with the bench's workload and settings, run through the RL loop
(``orchestration.driver.train``, the same code path as ``megatron-rl train``, so on one machine or a Ray cluster
over SLURM alike), and its own per-step metrics (``metrics.jsonl``: the ``perf/*``, ``time/*``, ``sync/*`` and
``memory/*`` figures the run logs) handed to :mod:`.summary`.

What the bench sets over the recipe (the user's overrides come first; these win):

* data: a generated prompt file (:func:`.workload.write_prompts`) with each prompt's response length;
  rollout: ``ignore_eos``, no dynamic sampling (every group trains: the batch size is the workload's);
* reward: :func:`.reward.bench_reward` in process; no imitation warm-up, no evaluation, no interval checkpoints;
* model: ``bench.model_config`` (an HF config) -> a random-weight model (:mod:`.model`), else the recipe's;
* steps: ``warmup + steps + 1``: the warm-up steps and the last step (which always checkpoints) are not timed;
* ``--mode trainer`` / ``engine``: one side of the step over the same run's phases (:mod:`.loops`), in ``sync``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_rl.bench.loops import MODES
from megatron_rl.bench.workload import Workload, write_prompts

BENCH_KEYS = {"model_config": None, "prompt_len": "fixed:16", "response_len": "fixed:32"}


@dataclass
class BenchSpec:
    recipe: str
    overrides: List[str] = field(default_factory=list)  # the run's, without the bench.* keys
    steps: int = 5
    warmup: int = 3
    mode: str = "full"
    out: Optional[str] = None  # the run folder; default runs/bench/<recipe name>
    model_config: Optional[str] = None
    workload: Workload = field(default_factory=Workload.parse)
    progress: bool = True
    settings: Dict[str, Optional[str]] = field(default_factory=lambda: dict(BENCH_KEYS))  # the bench.* values

    @classmethod
    def from_args(cls, recipe: str, overrides: Sequence[str], **kw) -> "BenchSpec":
        run, given = split_overrides(overrides)
        bench = {**BENCH_KEYS, **given}
        spec = cls(recipe, run, model_config=bench.get("model_config"),
                   workload=Workload.parse(bench["prompt_len"], bench["response_len"]), settings=bench, **kw)
        spec.check()
        return spec

    def with_overrides(self, overrides: Sequence[str], out: str) -> "BenchSpec":
        """This bench with more overrides (run or ``bench.*``) on top, into ``out``."""
        run, bench = split_overrides(overrides)
        settings = {**self.settings, **bench}
        spec = BenchSpec(self.recipe, self.overrides + run, self.steps, self.warmup, self.mode, out,
                         settings.get("model_config"), Workload.parse(settings["prompt_len"], settings["response_len"]),
                         self.progress, settings)
        spec.check()
        return spec

    def check(self) -> None:
        problems = []
        if self.steps < 1:
            problems.append(f"--steps={self.steps}: time at least 1 step")
        if self.warmup < 0:
            problems.append(f"--warmup={self.warmup}: must be >= 0 (1 or more: the first step compiles and warms caches)")
        if self.mode not in MODES:
            problems.append(f"--mode={self.mode!r}: one of {', '.join(MODES)} (full: the whole RL step; trainer: "
                            "train steps on one generated batch; engine: rollouts alone)")
        modes = [o.partition("=")[2] for o in self.overrides if o.partition("=")[0] == "rollout.mode"]
        if self.mode != "full" and any(m != "sync" for m in modes):
            problems.append(f"--mode {self.mode} with rollout.mode={modes[-1]}: one side of the step alone has nothing "
                            "to overlap and runs in sync; leave rollout.mode out (or use --mode full)")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def folder(self) -> str:
        name = os.path.splitext(os.path.basename(self.recipe))[0]
        return os.path.abspath(self.out or os.path.join("runs", "bench", name))

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps + 1


def split_overrides(overrides: Sequence[str]) -> Tuple[List[str], Dict[str, Optional[str]]]:
    """The run's overrides and the ``bench.*`` ones given (an unknown ``bench.`` key is an error naming the known)."""
    run, bench = [], {}
    for o in overrides:
        key, _, value = o.partition("=")
        if key.startswith("bench."):
            name = key[len("bench."):]
            if name not in BENCH_KEYS:
                raise ValueError(f"{key}: unknown bench setting; known: {', '.join('bench.' + k for k in BENCH_KEYS)}")
            bench[name] = value
        else:
            run.append(o)
    return run, bench


def run_overrides(spec: BenchSpec, prompts_file: str, model_dir: Optional[str]) -> List[str]:
    w = spec.workload
    out = [
        f"steps={spec.total_steps}", "overwrite=true", "resume=false", f"logging.output_dir={spec.folder}",
        f"data.path={prompts_file}", "data.label_field=answer", "data.metadata_fields=[max_new_tokens]",
        f"data.max_prompt_tokens={w.prompt.max + 2}", "data.overlong_policy=drop", "data.apply_chat_template=false",
        "reward.kind=custom", "reward.custom_fn=megatron_rl.bench.reward:bench_reward", "reward.in_process=true",
        "rollout.dynamic_sampling=false", "rollout.sampling.ignore_eos=true",
        f"rollout.sampling.max_new_tokens={w.response.max}",
        "warmup.steps=0", "warmup.teacher=null", "eval.interval=0", "eval.data=null", "eval.datasets={}",
        "checkpoint.interval=0", "checkpoint.save_hf=false",
        "logging.print_samples=0", "logging.progress=false",
    ]
    if model_dir:
        out.append(f"model.hf_path={model_dir}")
    if spec.mode != "full":
        out.append("rollout.mode=sync")  # one side alone: nothing to overlap (loops.py)
    return spec.overrides + out


def prepare(spec: BenchSpec):
    """The checked run config, with the model and the prompt file written; returns ``(cfg, workload facts)``."""
    from transformers import AutoTokenizer

    from megatron_rl.bench.model import random_model
    from megatron_rl.preflight import load_run_config

    os.makedirs(spec.folder, exist_ok=True)
    prompts = os.path.join(spec.folder, "bench_prompts.jsonl")
    if not os.path.exists(prompts):
        with open(prompts, "w") as f:  # a placeholder, so the first (unchecked) load finds a data file
            f.write('{"prompt": "w4", "answer": "", "max_new_tokens": 1}\n')
    model_dir = (random_model(spec.model_config, os.path.join(os.path.dirname(spec.folder), "_models"))
                 if spec.model_config else None)
    draft = load_run_config(spec.recipe, run_overrides(spec, prompts, model_dir), check=False)
    tok = AutoTokenizer.from_pretrained(draft.tokenizer_path)
    n = max(64, 2 * draft.rollout.prompts_per_step * (spec.total_steps + 2))
    facts = write_prompts(prompts, tok, spec.workload, n, seed=draft.seed)
    cfg = load_run_config(spec.recipe, run_overrides(spec, prompts, model_dir))
    return cfg, facts


def run(spec: BenchSpec):
    """Run the benchmark; returns ``(rows, cfg, workload facts)``: the run's step rows (``metrics.jsonl``,
    written by the run itself), its config and the realised mean lengths of the prompt file."""
    from megatron_rl.bench import loops
    from megatron_rl.metrics import read_metrics
    from megatron_rl.orchestration.driver import train

    cfg, facts = prepare(spec)
    metrics = os.path.join(spec.folder, "metrics.jsonl")
    if os.path.exists(metrics):  # the last bench's: the progress bar must not count it (the run removes it too)
        os.remove(metrics)
    loop = {"full": train, "trainer": loops.trainer_only, "engine": loops.engine_only}[spec.mode]
    with StepProgress(os.path.join(spec.folder, "metrics.jsonl"), spec.total_steps, spec.progress):
        loop(cfg)
    rows = [m for m in read_metrics(spec.folder) if m.get("step", 0) >= 1 and "time/step" in m]
    return rows, cfg, facts


class StepProgress:
    """A progress bar over the run's steps, fed by the lines the run appends to its ``metrics.jsonl``."""

    def __init__(self, path: str, total: int, enabled: bool):
        self.path, self.total, self.enabled = path, total, enabled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="bench-progress")

    def __enter__(self) -> "StepProgress":
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        from tqdm.auto import tqdm

        with tqdm(total=self.total, desc="bench steps", unit="step") as bar:
            done = 0
            while not self._stop.wait(0.5):
                try:
                    with open(self.path) as f:
                        lines = sum(1 for line in f if '"time/step"' in line)
                except OSError:
                    continue
                if lines > done:
                    bar.update(min(lines, self.total) - done)
                    done = min(lines, self.total)
