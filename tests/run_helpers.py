"""Helpers of the run-level tests: tiny assets without the teacher's fine-tune, and the CLI in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
TINY_RECIPE = str(REPO / "examples" / "tiny_cpu.yaml")
MOE_RECIPE = str(REPO / "examples" / "tiny_cpu_moe.yaml")
FAULT_SCRIPT = str(REPO / "tests" / "fault_hooks.py")  # the CLI with the faults of these variables installed
FAULT_ENV_NAMES = ("MEGATRON_RL_TEST_KILL_ENGINE", "MEGATRON_RL_FAULT")


def quick_assets(directory, model: str = "qwen3") -> Dict[str, str]:
    """The tiny recipe's assets with a barely trained teacher (20 fine-tune steps, ~1 s instead of ~7 s):
    it differs from the student, so the warm-up's gradient is not zero. ``model="qwen3_moe"``: the MoE
    recipe's."""
    from megatron_rl.data.tiny_task import prepare_tiny_arithmetic

    return prepare_tiny_arithmetic(str(directory), model=model, sft_steps=20)


def tiny_overrides(assets: Dict[str, str], out_dir, *extra: str, steps: int = 3, warmup: int = 2) -> List[str]:
    """A few-step version of examples/tiny_cpu.yaml on ``assets``, writing into ``out_dir``."""
    return [
        "prepare.kind=none", f"model.hf_path={assets['student']}", f"data.path={assets['train.jsonl']}",
        f"warmup.teacher={assets['teacher']}", f"eval.data.path={assets['eval.jsonl']}",
        f"logging.output_dir={out_dir}", f"steps={steps}", f"warmup.steps={warmup}",
        "rollout.prompts_per_step=8", "train.micro_batch_size=16", "eval.interval=2", "eval.max_prompts=16",
        "logging.progress=false", "checkpoint.keep_last=0", *extra,
    ]


def run_cli(args: List[str], timeout: float = 300.0, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """``megatron-rl <args>`` in a fresh interpreter (the real entry point; Ray starts and stops there);
    ``env``: extra environment variables; with a fault variable of ``fault_hooks.py`` among them, the CLI runs
    with those faults installed."""
    faults = any(name in (env or {}) for name in FAULT_ENV_NAMES)
    entry = [FAULT_SCRIPT] if faults else ["-m", "megatron_rl.cli"]
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0", TOKENIZERS_PARALLELISM="false",
               **(env or {}))
    proc = subprocess.run([sys.executable, *entry, *args], cwd=str(REPO), env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n" \
                                 f"{proc.stderr[-8000:]}"


def nontrivial(path) -> bool:
    """A real plot: over 10 KB, not one flat colour, and a few percent of its pixels inked (not near-white)."""
    import matplotlib.image as mpimg

    img = mpimg.imread(str(path))[..., :3]
    inked = (img.mean(-1) < 0.9).mean()
    return Path(path).stat().st_size > 10_000 and img.std() > 0.05 and inked > 0.01
