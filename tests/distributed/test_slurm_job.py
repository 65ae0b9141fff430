"""Real SLURM jobs from the rendered sbatch script: Ray up on every node, the command runs, Ray is
stopped afterwards - on success and on scancel.

Needs a SLURM controller answering on this machine: `bash scripts/setup_slurm.sh` (as root) sets
one up with two fake nodes on this host. Skipped with the reason otherwise.
"""

import json
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.launch.ray_cluster import find_cluster_processes
from megatron_rl.launch.slurm import SlurmConfig, ray_ports, render_sbatch

from run_helpers import TINY_RECIPE, nontrivial, quick_assets

# The program the job runs as its train command: connects to the job's Ray cluster, places one
# actor per node, records what it saw. argv: marker path, expected nodes.
PROBE = r'''
import json, os, sys, ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
marker, nodes = sys.argv[1], int(sys.argv[2])
ray.init(address="auto", logging_level="warning")
@ray.remote(num_cpus=1)
class Probe:
    def where(self):
        return ray.get_runtime_context().get_node_id(), os.environ.get("NCCL_SOCKET_IFNAME")
pg = placement_group([{"CPU": 1}] * nodes, strategy="STRICT_SPREAD")
assert pg.wait(timeout_seconds=60), "STRICT_SPREAD over all nodes did not fit"
actors = [Probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)).remote()
          for i in range(nodes)]
seen = ray.get([a.where.remote() for a in actors], timeout=60)
alive = [n for n in ray.nodes() if n["Alive"]]
with open(marker, "w") as f:
    json.dump({"address": os.environ.get("RAY_ADDRESS"), "seen": seen,
               "tags": sorted(k for n in alive for k in n["Resources"] if k.startswith("slurm_node:")),
               "cpus": ray.cluster_resources().get("CPU")}, f)
'''
SLEEPER = "import ray, time, sys; ray.init(); open(sys.argv[1], 'w').close(); time.sleep(600)"


def _slurm_nodes():
    """Names of the nodes of the default partition that take jobs, or a reason to skip."""
    if shutil.which("sbatch") is None:
        return None, "sbatch not on PATH (set up a local SLURM with: bash scripts/setup_slurm.sh, as root)"
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t %P"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return None, "slurmctld does not answer (sinfo timed out); run scripts/setup_slurm.sh"
    if out.returncode != 0:
        return None, f"slurmctld does not answer (sinfo: {out.stderr.strip()!r}); run scripts/setup_slurm.sh"
    nodes = sorted({line.split()[0] for line in out.stdout.splitlines()
                    if line.split()[2].endswith("*") and line.split()[1] in ("idle", "mix")})
    if not nodes:
        return None, f"no idle node in the default SLURM partition (sinfo: {out.stdout.strip()!r})"
    return nodes, ""


NODES, WHY = _slurm_nodes()
pytestmark = pytest.mark.skipif(NODES is None, reason=WHY)


def _job_state(job_id: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=15).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def _submit(tmp_path: Path, command: str, nodes: int, **overrides) -> tuple:
    settings = dict(
        nodes=nodes, gpus_per_node=0, cpus_per_task=1, time="10", job_name="mrl-test", log_dir=str(tmp_path / "logs"),
        # the job finds this interpreter (and `ray`) whatever PATH pytest was started with
        setup=[f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:$PATH"],
        ray_args=["--object-store-memory=80000000"], ray_start_timeout_s=90,
        # fake nodes share this host, so each node needs its own ports (harmless on real nodes)
        ray_node_port_stride=64, ray_ports_per_job=256)
    cfg = SlurmConfig(**{**settings, **overrides})
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(cfg, command))
    (tmp_path / "logs").mkdir()
    out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0], cfg


def _wait_gone(job_id: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = _job_state(job_id)
        if state.get("JobState") not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return state
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], timeout=15)  # our own job, by id
    pytest.fail(f"job {job_id} still {state.get('JobState')} after {timeout_s} s")


def _output(tmp_path: Path, job_id: str) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((tmp_path / "logs").glob(f"*{job_id}*")))


def _assert_cleaned_up(job_id: str, cfg: SlurmConfig, log: str):
    """No process of this job's Ray is left (found by its temp dir) and its GCS port is closed."""
    deadline = time.monotonic() + 10
    while (left := find_cluster_processes(f"/tmp/ray-j{job_id}")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"Ray processes left after job {job_id}: {left}\n{log}"
    with socket.socket() as s:
        s.settimeout(2)
        assert s.connect_ex(("127.0.0.1", ray_ports(cfg, int(job_id))["gcs"])) != 0, "GCS port still open"
    shutil.rmtree(f"/tmp/ray-j{job_id}", ignore_errors=True)  # the job keeps Ray's logs there


@pytest.fixture
def job_nodes():
    return min(2, len(NODES))


def test_job_runs_command_on_ray_cluster_and_cleans_up(tmp_path, job_nodes):
    (tmp_path / "probe.py").write_text(PROBE)
    marker = tmp_path / "marker.json"
    t0 = time.monotonic()
    job_id, cfg = _submit(tmp_path, f"python3 {tmp_path / 'probe.py'} {marker} {job_nodes}", job_nodes)
    state = _wait_gone(job_id, 150)
    log = _output(tmp_path, job_id)
    print(f"job {job_id} on {job_nodes} node(s): {state.get('JobState')} in {time.monotonic() - t0:.1f} s")
    assert state.get("JobState") == "COMPLETED" and state.get("ExitCode") == "0:0", log
    info = json.loads(marker.read_text())
    assert info["address"].endswith(f":{ray_ports(cfg, int(job_id))['gcs']}")
    assert info["cpus"] == job_nodes and len(info["tags"]) == job_nodes
    assert len({node for node, _ in info["seen"]}) == job_nodes, "actors did not land on distinct nodes"
    # every Ray worker sees the interface chosen for its node
    assert all(iface and Path(f"/sys/class/net/{iface}").exists() for _, iface in info["seen"]), info
    assert f"{job_nodes} nodes joined" in log and "done (exit status 0)" in log
    _assert_cleaned_up(job_id, cfg, log)


def test_scancel_stops_ray_on_every_node(tmp_path, job_nodes):
    started = tmp_path / "started"
    job_id, cfg = _submit(tmp_path, f"python3 -c {shlex.quote(SLEEPER)} {started}", job_nodes)
    deadline = time.monotonic() + 120
    while not started.exists():
        state = _job_state(job_id).get("JobState")
        if state not in ("PENDING", "CONFIGURING", "RUNNING") or time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], timeout=15)
            pytest.fail(f"the command never started (job {state}):\n{_output(tmp_path, job_id)}")
        time.sleep(0.5)
    assert find_cluster_processes(f"/tmp/ray-j{job_id}"), "no Ray processes found while the job runs"
    subprocess.run(["scancel", job_id], check=True, timeout=15)
    state = _wait_gone(job_id, 60)
    log = _output(tmp_path, job_id)
    assert state.get("JobState") == "CANCELLED", log
    assert "got SIGTERM" in log and "cleaning up" in log, log
    _assert_cleaned_up(job_id, cfg, log)


def test_bad_interface_fails_fast_with_the_reason(tmp_path, job_nodes):
    t0 = time.monotonic()
    job_id, cfg = _submit(tmp_path, "true", job_nodes, network_interface="nope0")
    state = _wait_gone(job_id, 60)
    log = _output(tmp_path, job_id)
    assert state.get("JobState") == "FAILED" and state.get("ExitCode") == "1:0", log
    assert "network_interface=nope0 has no IPv4 address" in log and "ERROR: no head address" in log, log
    assert time.monotonic() - t0 < 30
    _assert_cleaned_up(job_id, cfg, log)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_sweep_in_a_two_node_job_writes_the_scaling_table(tmp_path, job_nodes):
    """``megatron-rl bench --sweep`` as the command of a two-node job (the same command as on one machine, on the
    job's Ray: ``cluster.address=auto``): both points run, each with its own bench folder, and the scaling table
    and plot compare them (colocated on 2 devices, disaggregated on 3: with two CPUs per node, it spans both)."""
    if job_nodes < 2:
        pytest.skip("needs two SLURM nodes (scripts/setup_slurm.sh sets up two)")
    assets = quick_assets(tmp_path / "assets")
    out = tmp_path / "sweep"
    command = " ".join(shlex.quote(a) for a in [
        sys.executable, "-m", "megatron_rl.cli", "bench", TINY_RECIPE, "prepare.kind=none",
        f"model.hf_path={assets['student']}", "rollout.prompts_per_step=4", "bench.prompt_len=fixed:6",
        "bench.response_len=fixed:4", "cluster.address=auto", "--steps", "1", "--warmup", "1", "--no-progress",
        "--out", str(out), "--sweep", "rollout.placement=colocated,disaggregated"])
    env = ["export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false"]
    job_id, cfg = _submit(tmp_path, command, 2, cpus_per_task=2, time="15",
                          setup=[f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:$PATH", *env])
    state = _wait_gone(job_id, 840)
    log = _output(tmp_path, job_id)
    assert state.get("JobState") == "COMPLETED" and state.get("ExitCode") == "0:0", log[-6000:]
    assert "2 nodes joined" in log
    points = json.loads((out / "scaling.json").read_text())["points"]
    assert [(p["name"], p["devices"]) for p in points] == [("placement=colocated", 2), ("placement=disaggregated", 3)]
    for p in points:
        bench = json.loads((out / p["name"] / "bench.json").read_text())
        assert bench["timed_steps"] == [2] and bench["stats"]["time/step"]["median"] > 0
        assert p["stats"]["perf/tokens_per_s_per_gpu"] > 0
    table = (out / "scaling.md").read_text()
    assert "| placement=disaggregated | 3 |" in table and "efficiency vs linear" in table
    assert nontrivial(out / "scaling.png")
    _assert_cleaned_up(job_id, cfg, log)
