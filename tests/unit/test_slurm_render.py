"""The sbatch script rendered by megatron_rl.launch.slurm: content, port arithmetic, CLI. No SLURM needed.

The bash parts (job port block, the per-node script) are executed with bash against a stand-in
`ray` executable that prints its arguments, so the ports the script would pass are compared with
:func:`ray_ports` - the same numbers, derived from SLURM_JOB_ID.
"""

import os
import re
import shlex
import stat
import subprocess
from pathlib import Path

import pytest

from megatron_rl import cli, config_io
from megatron_rl.launch.slurm import SlurmConfig, ray_ports, render_sbatch

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_COMMAND = "megatron-rl train examples/qwen3_dense.yaml rollout.n_samples_per_prompt=8"


def _render(**kw) -> str:
    return render_sbatch(SlurmConfig(**kw), "python3 train.py --steps 3")


def test_rendered_script_has_resources_trap_ports_and_interface():
    text = _render(nodes=2, gpus_per_node=8, cpus_per_task=32, partition="gpu", account="acc", time="1-00:00:00",
                   network_interface="ib0", env={"NCCL_DEBUG": "INFO"}, setup=["source /venv/bin/activate"])
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gres=gpu:8",
                 "#SBATCH --cpus-per-task=32", "#SBATCH --partition=gpu", "#SBATCH --account=acc",
                 "#SBATCH --time=1-00:00:00", "#SBATCH --output=logs/slurm/%x-%j.out"):
        assert line in text.splitlines(), line
    # ports come from the job id; cleanup runs on every exit path; NCCL/gloo follow the interface
    assert "% RAY_SLOTS" in text and "SLURM_JOB_ID" in text.split("% RAY_SLOTS")[0].splitlines()[-1]
    assert "trap cleanup EXIT" in text and re.search(r"^trap .*exit 143.* TERM$", text, re.M)
    assert "NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$iface}" in text and "GLOO_SOCKET_IFNAME" in text
    assert "NETWORK_INTERFACE=ib0" in text and "export NCCL_DEBUG=INFO" in text
    assert "source /venv/bin/activate" in text
    # one Ray auth mode and token for the whole job (a stray ~/.ray/auth_token must not split it)
    assert "export RAY_AUTH_MODE=token" in text and "export RAY_AUTH_TOKEN=" in text
    assert "TRAIN_COMMAND='python3 train.py --steps 3'" in text
    # no name-based killing anywhere (it would hit other jobs' Ray on shared nodes)
    assert not re.search(r"\b(pkill|killall)\b|ray stop\b(?!`)", text.replace("`ray stop`/`pkill`", ""))
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_whole_node_and_cpu_only_options():
    text = _render(gpus_per_node=0, cpus_per_task=None)
    assert "#SBATCH --exclusive" in text and "--gres" not in text.split("set -uo")[0]
    assert "CPUS_PER_NODE=$SLURM_CPUS_ON_NODE" in text


def _bash(script: str, env: dict) -> str:
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={**os.environ, **env}, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("job_id,stride", [(1234, 0), (98765, 0), (7, 64)])
def test_bash_ports_match_python(tmp_path, job_id, stride):
    cfg = SlurmConfig(nodes=2, gpus_per_node=0, cpus_per_task=2, ray_node_port_stride=stride,
                      ray_ports_per_job=256 if stride else 512)
    text = render_sbatch(cfg, "true")
    fake_ray = tmp_path / "ray"
    fake_ray.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')  # one argument per line
    fake_ray.chmod(fake_ray.stat().st_mode | stat.S_IEXEC)
    # the job-level part (port block, exports) plus the per-node script definition, then one node
    prologue = text.split("# ---- cleanup, on every exit path")[0]
    env = {"SLURM_JOB_ID": str(job_id), "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURMD_NODENAME": "n2"}
    gcs = _bash(prologue + '\necho "$RAY_GCS_PORT $RAY_CLIENT_PORT $RAY_DASHBOARD_PORT"', env).split()
    want = ray_ports(cfg, job_id, node_index=1)
    assert [int(p) for p in gcs] == [want["gcs"], want["client_server"], want["dashboard"]]
    args = _bash(prologue + '\nbash -c "$RAY_NODE_SH" ray-node worker 1 127.0.0.1', env).splitlines()
    assert args[0].startswith("[ray-node] worker on n2") and args[1:3] == ["start", "--address=127.0.0.1:%d" % want["gcs"]]
    flags = dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)
    for name in ("node_manager", "object_manager", "dashboard_agent_grpc", "dashboard_agent_listen",
                 "metrics_export", "runtime_env_agent", "min_worker", "max_worker"):
        assert int(flags["--" + name.replace("_", "-") + "-port"]) == want[name], name
    assert flags["--temp-dir"] == f"/tmp/ray-j{job_id}" and flags["--num-gpus"] == "0"
    assert flags["--resources"] == '{"slurm_node:n2": 1}'
    # the whole block stays inside the job's slot, below the ephemeral port range
    assert want["gcs"] <= min(want.values()) and max(want.values()) < want["gcs"] + cfg.ray_ports_per_job <= 32768


def test_port_blocks_of_neighbouring_jobs_do_not_overlap():
    cfg = SlurmConfig()
    blocks = [set(range(ray_ports(cfg, j)["gcs"], ray_ports(cfg, j)["gcs"] + cfg.ray_ports_per_job))
              for j in range(5000, 5040)]
    assert all(not (a & b) for i, a in enumerate(blocks) for b in blocks[i + 1:])


@pytest.mark.parametrize("kw,msg", [
    (dict(nodes=0), "nodes=0"),
    (dict(time="tomorrow"), "time='tomorrow'"),
    (dict(time=14400), "time=14400: write the time limit as a quoted string"),
    (dict(partition="gpu queue"), "partition="),
    (dict(env={"BAD-NAME": "1"}), "BAD-NAME"),
    (dict(nodes=8, ray_node_port_stride=64, ray_ports_per_job=256), "ray_ports_per_job=256: needs at least 515"),
    (dict(ray_port_base=32700), "does not fit"),
])
def test_config_errors_say_what_to_change(kw, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        SlurmConfig(**kw)


def test_cli_dry_run_merges_recipe_site_flags_and_overrides(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("slurm: {nodes: 4, partition: a}\nmodel: {name: tiny}\n")
    site = tmp_path / "site.yaml"
    site.write_text("slurm: {partition: b, time: '02:00:00'}\n")
    rc = cli.main(["slurm", str(recipe), "rollout.n=8", "--slurm-config", str(site), "slurm.job_name=exp1",
                   "--gpus-per-node", "4", "--dry-run", "data.seed=3"])
    text = capsys.readouterr().out
    assert rc == 0
    for line in ("--nodes=4", "--partition=b", "--time=02:00:00", "--gres=gpu:4", "--job-name=exp1"):
        assert f"#SBATCH {line}" in text
    assert f"TRAIN_COMMAND={shlex.quote(f'megatron-rl train {recipe} rollout.n=8 data.seed=3')}" in text


def test_cli_reports_config_errors(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("slurm: {nodez: 2}\n")
    assert cli.main(["slurm", str(recipe), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "slurm.nodez: unknown field; did you mean 'nodes'?" in err


def test_committed_example_is_up_to_date():
    site = config_io.load_yaml(REPO / "examples/slurm/cluster_2x8.yaml")["slurm"]
    expected = render_sbatch(config_io.build(SlurmConfig, site, "slurm"), EXAMPLE_COMMAND)
    assert (REPO / "examples/slurm/ray_2x8.sbatch").read_text() == expected, (
        "examples/slurm/ray_2x8.sbatch is stale; regenerate it with: megatron-rl slurm examples/slurm/cluster_2x8.yaml "
        f"--command '{EXAMPLE_COMMAND}' --dry-run > examples/slurm/ray_2x8.sbatch")
