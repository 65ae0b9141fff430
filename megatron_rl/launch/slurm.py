"""SLURM launch: an sbatch script rendered from :mod:`.sbatch_template` and a validated :class:`SlurmConfig`.

The script brings up a Ray cluster over the allocation (head + one worker per node, ports derived
from the job id, network interface chosen per node), waits for every node and GPU, runs the train
command on the head node and stops Ray on every node on exit. See examples/slurm/README.md.

    cfg = SlurmConfig(nodes=2, gpus_per_node=8, partition="gpu")
    text = render_sbatch(cfg, "megatron-rl train examples/qwen3.yaml rollout.n_samples_per_prompt=8")
    job_id = submit(text, cfg)
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from megatron_rl import config_io
from megatron_rl.launch.sbatch_template import TEMPLATE

_SBATCH_TOKEN = re.compile(r"^[^\s'\"\\]+$")  # #SBATCH lines are not shell-parsed: no spaces or quotes
_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^(\d+-\d+)$|^(?i:infinite|unlimited)$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PER_NODE_PORTS = 6  # node manager, object manager, agent grpc + http, metrics, runtime-env agent


@dataclass
class SlurmConfig:
    """Resources and environment of a SLURM job running a Ray cluster (the ``slurm:`` section)."""

    nodes: int = 1
    gpus_per_node: int = 8  # 0 on CPU nodes: the job then waits for CPUs instead
    cpus_per_task: Optional[int] = None  # CPUs per node for Ray; None = the whole node (--exclusive)
    partition: Optional[str] = None
    account: Optional[str] = None
    time: Union[str, int] = "04:00:00"  # a string; int only to explain YAML's base-60 reading (below)
    job_name: str = "megatron-rl"
    log_dir: str = "logs/slurm"  # job output and one Ray log per node, relative to the working dir
    workdir: Optional[str] = None  # --chdir; None = where sbatch is run
    exclusive: bool = False  # also --exclusive when cpus_per_task is set
    network_interface: Optional[str] = None  # e.g. "ib0"; None = the route to the head node
    ray_port_base: int = 10000  # job port blocks live in [ray_port_base, ray_port_limit)
    ray_port_limit: int = 32768  # Linux's ephemeral ports start here (net.ipv4.ip_local_port_range)
    ray_ports_per_job: int = 512  # 3 head ports (GCS, client, dashboard), then per node 6 + worker ports
    ray_node_port_stride: int = 0  # >0 only when several SLURM nodes share one host (test clusters)
    ray_start_timeout_s: int = 600  # for all nodes and GPUs to join
    ray_args: List[str] = field(default_factory=list)  # extra `ray start` flags on every node
    setup: List[str] = field(default_factory=list)  # shell lines run first: venv/conda/module activation
    env: Dict[str, str] = field(default_factory=dict)  # exported after setup, seen by every node and Ray worker
    srun_args: List[str] = field(default_factory=list)  # added to every srun, e.g. --container-image=...
    sbatch_args: List[str] = field(default_factory=list)  # extra #SBATCH options, e.g. --qos=high

    def __post_init__(self):
        for name in ("nodes", "ray_start_timeout_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: expected at least 1")
        if self.gpus_per_node < 0:
            raise ValueError(f"gpus_per_node={self.gpus_per_node}: expected 0 (CPU nodes) or more")
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise ValueError(f"cpus_per_task={self.cpus_per_task}: expected at least 1, or null for whole nodes")
        if isinstance(self.time, int):
            raise ValueError(f"time={self.time}: write the time limit as a quoted string, e.g. '24:00:00' (unquoted, "
                             "YAML reads 24:00:00 as the base-60 number 86400), or use --time 24:00:00")
        if not _TIME.match(self.time):
            raise ValueError(f"time={self.time!r}: expected a SLURM time limit such as 04:00:00, 1-00:00:00 or 90")
        for name in ("job_name", "partition", "account", "log_dir", "workdir", "network_interface"):
            value = getattr(self, name)
            if value is not None and not _SBATCH_TOKEN.match(value):
                raise ValueError(f"{name}={value!r}: must be non-empty without spaces or quotes")
        for arg in self.sbatch_args:
            if not arg.startswith("-") or "\n" in arg:
                raise ValueError(f"sbatch_args: {arg!r} is not an option such as --qos=high")
        for key in self.env:
            if not _ENV_NAME.match(key):
                raise ValueError(f"env: {key!r} is not a valid environment variable name")
        self._check_ports()

    def _check_ports(self) -> None:
        if not 1024 <= self.ray_port_base < self.ray_port_limit <= 65536:
            raise ValueError(f"ray_port_base={self.ray_port_base}, ray_port_limit={self.ray_port_limit}: "
                             "expected 1024 <= ray_port_base < ray_port_limit <= 65536")
        min_node = _PER_NODE_PORTS + 8  # at least 8 worker ports per node
        if self.ray_node_port_stride:
            if self.ray_node_port_stride < min_node:
                raise ValueError(f"ray_node_port_stride={self.ray_node_port_stride}: expected 0 or at least {min_node}")
            need = 3 + self.nodes * self.ray_node_port_stride
        else:
            need = 3 + min_node
        if self.ray_ports_per_job < need:
            raise ValueError(f"ray_ports_per_job={self.ray_ports_per_job}: needs at least {need} "
                             f"for nodes={self.nodes}, ray_node_port_stride={self.ray_node_port_stride}")
        if self.ray_port_base + self.ray_ports_per_job > self.ray_port_limit:
            raise ValueError(f"ray_ports_per_job={self.ray_ports_per_job} does not fit in "
                             f"[ray_port_base={self.ray_port_base}, ray_port_limit={self.ray_port_limit})")


def ray_ports(cfg: SlurmConfig, job_id: int, node_index: int = 0) -> Dict[str, int]:
    """The Ray ports of ``node_index`` in job ``job_id`` - the same arithmetic as the sbatch script.

    Jobs sharing a node use different blocks unless their ids are equal modulo the slot count.
    """
    slots = (cfg.ray_port_limit - cfg.ray_port_base) // cfg.ray_ports_per_job
    job = cfg.ray_port_base + (job_id % slots) * cfg.ray_ports_per_job
    base = job + 3 + node_index * cfg.ray_node_port_stride
    span = cfg.ray_node_port_stride or cfg.ray_ports_per_job - 3
    names = ("node_manager", "object_manager", "dashboard_agent_grpc", "dashboard_agent_listen",
             "metrics_export", "runtime_env_agent")
    ports = {"gcs": job, "client_server": job + 1, "dashboard": job + 2, **{n: base + i for i, n in enumerate(names)}}
    ports.update(min_worker=base + _PER_NODE_PORTS, max_worker=base + span - 1)
    return ports


def _sbatch_lines(cfg: SlurmConfig) -> List[str]:
    opts = [f"--job-name={cfg.job_name}", f"--nodes={cfg.nodes}", "--ntasks-per-node=1"]
    if cfg.cpus_per_task is not None:
        opts.append(f"--cpus-per-task={cfg.cpus_per_task}")
    if cfg.cpus_per_task is None or cfg.exclusive:
        opts.append("--exclusive")
    if cfg.gpus_per_node:
        opts.append(f"--gres=gpu:{cfg.gpus_per_node}")
    opts.append(f"--time={cfg.time}")
    opts += [f"--{k}={v}" for k, v in (("partition", cfg.partition), ("account", cfg.account)) if v]
    opts.append(f"--output={cfg.log_dir}/%x-%j.out")
    if cfg.workdir:
        opts.append(f"--chdir={cfg.workdir}")
    return ["#SBATCH " + o for o in opts + list(cfg.sbatch_args)]


def render_sbatch(cfg: SlurmConfig, train_command: str) -> str:
    """The sbatch script for ``cfg`` running ``train_command`` (a shell command line) on the head node."""
    if not isinstance(cfg, SlurmConfig):
        raise TypeError(f"render_sbatch: cfg must be a SlurmConfig, got {type(cfg).__name__}")
    if not train_command.strip() or "\0" in train_command:
        raise ValueError("render_sbatch: train_command is empty (expected e.g. 'megatron-rl train recipe.yaml')")
    q = shlex.quote
    values = {
        "sbatch_lines": "\n".join(_sbatch_lines(cfg)),
        "gpus_per_node": str(cfg.gpus_per_node),
        # whole nodes: what SLURM gave the job on the node, read at run time
        "cpus_per_node": str(cfg.cpus_per_task) if cfg.cpus_per_task else "$SLURM_CPUS_ON_NODE",
        "network_interface": q(cfg.network_interface or ""),
        "ray_port_base": str(cfg.ray_port_base),
        "ray_port_limit": str(cfg.ray_port_limit),
        "ray_ports_per_job": str(cfg.ray_ports_per_job),
        "ray_node_port_stride": str(cfg.ray_node_port_stride),
        "ray_start_timeout_s": str(cfg.ray_start_timeout_s),
        "ray_args": q(shlex.join(cfg.ray_args)),
        "srun_args": " ".join(q(a) for a in cfg.srun_args),
        "log_dir": q(cfg.log_dir),
        "train_command": q(train_command),
        "setup": "\n".join(cfg.setup) if cfg.setup else "# (no setup lines)",
        "env": "\n".join(f"export {k}={q(str(v))}" for k, v in cfg.env.items()),
    }
    used = set()

    def fill(m: re.Match) -> str:
        used.add(m.group(1))
        return values[m.group(1)]

    text = re.sub(r"\{\{ (\w+) \}\}", fill, TEMPLATE)
    assert used == set(values), f"template and values disagree: {set(values) ^ used}"
    return text


def submit(script: str, cfg: SlurmConfig, save_to: Optional[str] = None) -> str:
    """Write ``script`` (into the log dir unless ``save_to``), ``sbatch`` it, return the job id."""
    root = Path(cfg.workdir or ".")
    log_dir = root / cfg.log_dir
    log_dir.mkdir(parents=True, exist_ok=True)  # sbatch does not create it: the job would fail silently
    path = Path(save_to) if save_to else log_dir / f"{cfg.job_name}-{time.strftime('%Y%m%d-%H%M%S')}.sbatch"
    path.write_text(script)
    try:
        out = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise RuntimeError("sbatch not found on PATH: run on a SLURM login node, or use --dry-run") from None
    if out.returncode != 0:
        raise RuntimeError(f"sbatch {path} failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip().split(";")[0]  # "<id>" or "<id>;<cluster>"


# ---- command line: `megatron-rl slurm RECIPE [key=value ...] [--nodes N ...] [--dry-run]`

SBATCH_FLAGS = (("nodes", int), ("gpus_per_node", int), ("cpus_per_task", int), ("partition", str),
          ("account", str), ("time", str), ("job_name", str), ("network_interface", str))


def config_from_args(args: argparse.Namespace) -> Tuple[SlurmConfig, str]:
    """SlurmConfig (recipe section < --slurm-config < flags < slurm.* overrides) and the train command."""
    recipe = config_io.load_yaml(args.recipe)  # fail now, not after hours in the queue
    data = dict(recipe.get("slurm") or {})
    if args.slurm_config:
        site = config_io.load_yaml(args.slurm_config)
        data = config_io.merge(data, site.get("slurm", site))
    data = config_io.merge(data, {n: getattr(args, n) for n, _ in SBATCH_FLAGS if getattr(args, n) is not None})
    slurm_over = [o[len("slurm."):] for o in args.overrides if o.startswith("slurm.")]
    train_over = [o for o in args.overrides if not o.startswith("slurm.")]
    data = config_io.merge(data, config_io.parse_overrides(slurm_over))
    cfg = config_io.build(SlurmConfig, data, "slurm")
    if args.command:
        if train_over:
            raise ValueError(f"overrides {train_over} would be ignored with --command: put them in the command")
        return cfg, args.command
    return cfg, shlex.join(["megatron-rl", "train", args.recipe, *train_over])


