"""The tiny run the reliability replay (``tools/chaos.py``) drives: assets, overrides, a run as a process tree,
its sockets and metrics."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from typing import Dict, List, Optional

from megatron_rl.metrics import RECOVERY_COUNTERS, WALL_CLOCK

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(REPO, "examples", "tiny_cpu.yaml")
NOT_COMPARED = (*WALL_CLOCK, *RECOVERY_COUNTERS)  # between runs: wall clock, and engine recovery's own counters


# ---------------------------------------------------------------------------------------------------------
# the tiny run
# ---------------------------------------------------------------------------------------------------------


def assets(directory: str) -> Dict[str, str]:
    """The tiny recipe's assets with a barely trained teacher (quick to make)."""
    from megatron_rl.data.tiny_task import prepare_tiny_arithmetic

    return prepare_tiny_arithmetic(directory, sft_steps=20)


def overrides(a: Dict[str, str], out: str, *extra: str, steps: int = 6, warmup: int = 6) -> List[str]:
    return ["prepare.kind=none", f"model.hf_path={a['student']}", f"data.path={a['train.jsonl']}",
            f"warmup.teacher={a['teacher']}", f"eval.data.path={a['eval.jsonl']}", f"logging.output_dir={out}",
            f"steps={steps}", f"warmup.steps={warmup}", "rollout.prompts_per_step=8", "train.micro_batch_size=16",
            "eval.interval=0", "logging.progress=false", "checkpoint.save_hf=false", *extra]


def env() -> Dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0", TOKENIZERS_PARALLELISM="false")


class Run:
    """``megatron-rl train`` in a subprocess, its log, and its process tree."""

    def __init__(self, args: List[str], log: str, extra_env: Optional[Dict[str, str]] = None):
        self.log_path = log
        self._log = open(log, "w")
        # a fault variable among extra_env: the CLI with the test fault hooks installed (tests/fault_hooks.py)
        entry = [os.path.join(REPO, "tests", "fault_hooks.py")] if extra_env else ["-m", "megatron_rl.cli"]
        self.proc = subprocess.Popen([sys.executable, *entry, "train", RECIPE, *args], cwd=REPO,
                                     env={**env(), **(extra_env or {})}, stdout=self._log, stderr=subprocess.STDOUT)

    def text(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_for(self, pattern: str, timeout: float = 600.0) -> bool:
        """Until ``pattern`` (a regex) is in the log; False if the run ended first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if re.search(pattern, self.text(), re.M):
                return True
            if self.proc.poll() is not None:
                return bool(re.search(pattern, self.text(), re.M))
            time.sleep(0.2)
        raise TimeoutError(f"{pattern!r} not in {self.log_path} after {timeout} s")

    def descendants(self) -> Dict[int, str]:
        """``{pid: command line}`` of every process below the driver."""
        return descendants(self.proc.pid)

    def wait(self, timeout: float = 900.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._log.close()


def descendants(root: int) -> Dict[int, str]:
    children: Dict[int, List[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        todo += children.get(pid, [])
    return out


def alive(pids) -> List[int]:
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":  # a zombie has exited
                    out.append(pid)
        except OSError:
            pass
    return out


def listening_sockets(pids) -> List[str]:
    """``address:port`` of every listening TCP socket owned by ``pids`` (``ss -ltnp``)."""
    text = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    wanted = {str(p) for p in pids}
    return sorted({line.split()[3] for line in text.splitlines()
                   if any(pid in wanted for pid in re.findall(r"pid=(\d+)", line))})


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1") or host.startswith("::ffff:127.")


def metrics(out: str) -> List[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def metric_differences(a: List[dict], b: List[dict], rel: float = 1e-5, abs_: float = 1e-6) -> List[str]:
    """What differs between two runs' lines (:data:`NOT_COMPARED` excluded); empty when they agree."""
    diffs = []
    if [m["step"] for m in a] != [m["step"] for m in b]:
        return [f"steps {[m['step'] for m in a]} vs {[m['step'] for m in b]}"]
    for ma, mb in zip(a, b):
        ka = {k for k in ma if not k.startswith(NOT_COMPARED)}
        kb = {k for k in mb if not k.startswith(NOT_COMPARED)}
        if ka != kb:
            diffs.append(f"step {ma['step']}: keys differ {sorted(ka ^ kb)}")
        for k in sorted(ka & kb):
            x, y = ma[k], mb[k]
            if isinstance(x, str) or isinstance(y, str):
                same = x == y
            else:
                same = abs(x - y) <= abs_ + rel * abs(x)
            if not same:
                diffs.append(f"step {ma['step']}: {k} {x} vs {y}")
    return diffs
