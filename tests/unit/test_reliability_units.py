"""Issue 16's parts that need no Ray: the parent-death guard, the loopback rendezvous and weight-group stores,
signals, the no-update watch, the output directory of a failed start, the metrics line kept through a resume,
checkpoint manifests and model-file checks, and the message naming a dead actor."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_rl.orchestration import failures, ray_guard
from megatron_rl.orchestration.driver import NoUpdateWatch, warn_numerics
from megatron_rl.orchestration.signals import Interrupted, StopSignals, keep_handlers
from megatron_rl.training import checkpoint_integrity as integrity

from run_helpers import TINY_RECIPE, quick_assets, tiny_overrides


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard reads /proc (Linux)")
def test_guard_kills_the_runs_processes_when_the_driver_is_killed(tmp_path):
    """A fake driver starts the guard and three processes: one holding a file in the watched directory (Ray's
    processes, which overwrite their environment with their title), one inheriting the token, one started with
    a clean environment elsewhere (not the run's). SIGKILL of the driver: the first two die, the third lives."""
    session = tmp_path / "session"
    session.mkdir()
    driver = textwrap.dedent(f"""
        import os, subprocess, sys, time
        from megatron_rl.orchestration.ray_guard import Guard, ENV
        g = Guard()
        g.watch({str(session)!r})
        holder = subprocess.Popen([sys.executable, "-c", "import time; f = open({str(session / 'log')!r}, 'w'); time.sleep(600)"],
                                  env={{k: v for k, v in os.environ.items() if k != ENV}})
        marked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(holder.pid, marked.pid, g.proc.pid, flush=True)
        time.sleep(600)
    """)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    try:
        holder, marked, guard = map(int, proc.stdout.readline().split())
        time.sleep(0.5)  # the holder opens its file
        assert all(_alive(p) for p in (holder, marked, guard))
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(p) for p in (holder, marked, guard)):
            time.sleep(0.1)
        assert not _alive(holder) and not _alive(marked) and not _alive(guard)
        assert _alive(bystander.pid)
    finally:
        bystander.kill()
        proc.kill()


def test_guard_released_normally_leaves_the_driver_alone(tmp_path):
    g = ray_guard.Guard()
    try:
        assert os.environ[ray_guard.ENV] == g.token
        g.watch(str(tmp_path))
    finally:
        g.release()
    assert ray_guard.ENV not in os.environ and g.proc is None  # the guard swept (nothing) and exited


def _listening(port: int):
    listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout
    return [line.split()[3] for line in listening.splitlines() if line.split()[3].endswith(f":{port}")]


def test_rendezvous_store_listens_on_its_host_only():
    from megatron_rl import parallel

    store = parallel.rendezvous_store("127.0.0.1", 0, 2, is_master=True, timeout_s=30)
    client = parallel.rendezvous_store("127.0.0.1", store.port, 2, is_master=False, timeout_s=30)
    client.set("k", "v")
    assert store.get("k") == b"v"
    assert _listening(store.port) == [f"127.0.0.1:{store.port}"]


def test_weight_group_store_listens_on_its_host_only():
    """The distributed transport's store (trainer rank 0 hosts, engine ranks join as TCPStore clients, as SGLang
    does), on an OS-picked port (the balancer's) and on a fixed one."""
    import torch
    import torch.distributed as dist

    from megatron_rl.parallel import _free_port
    from megatron_rl.weights import group as weight_group

    store = weight_group.host_store("127.0.0.1", 2, timeout_s=30)
    joined = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=store.timeout, multi_tenant=True)
    joined.set("k", "v")
    assert store.get("k") == b"v"
    assert _listening(store.port) == [f"127.0.0.1:{store.port}"]
    port = _free_port()
    group = weight_group.create_weight_group("127.0.0.1", port, 0, 1, "gloo", "loopback_only", 30)
    weight_group.broadcast_bucket(group, [("w", torch.ones(3))])
    assert _listening(port) == [f"127.0.0.1:{port}"]
    weight_group.destroy_weight_group(group)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the loopback interface is named lo on Linux")
def test_a_local_runs_workers_bind_gloo_to_loopback(monkeypatch):
    """Gloo listens on what the hostname resolves to (often the network address): a local run's workers get
    GLOO_SOCKET_IFNAME=lo, a cluster run's do not, and a user's own choice stays (Ray's processes inherit it)."""
    from megatron_rl.config import ClusterConfig
    from megatron_rl.orchestration.placement import worker_env

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    env = worker_env(ClusterConfig())
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["OMP_NUM_THREADS"] == "1"
    assert "GLOO_SOCKET_IFNAME" not in worker_env(ClusterConfig(address="auto"))
    child = textwrap.dedent("""
        import os, subprocess, torch.distributed as dist
        from megatron_rl import parallel
        store = parallel.rendezvous_store("127.0.0.1", 0, 1, is_master=True, timeout_s=30)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
        print(" ".join(line.split()[3] for line in out.splitlines() if f"pid={os.getpid()}," in line))
    """)
    proc = subprocess.run([sys.executable, "-c", child], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sockets = proc.stdout.split()
    assert len(sockets) >= 2 and all(a.startswith("127.0.0.1:") for a in sockets), sockets  # store + gloo
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    assert "GLOO_SOCKET_IFNAME" not in worker_env(ClusterConfig())


def test_signals_graceful_then_immediate(caplog):
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals(graceful=True) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested == signal.SIGTERM  # noted: the step finishes, is checkpointed, then the run stops
        with pytest.raises(Interrupted) as info:
            os.kill(os.getpid(), signal.SIGTERM)  # a second one stops at once
        assert info.value.signum == signal.SIGTERM
    with StopSignals(graceful=False):
        with pytest.raises(Interrupted) as info:
            os.kill(os.getpid(), signal.SIGINT)
        assert isinstance(info.value, KeyboardInterrupt) and info.value.signum == signal.SIGINT
    assert signal.getsignal(signal.SIGTERM) == before  # restored


def test_ray_init_leaves_the_runs_sigterm_handler_in_place():
    """ray.init sets ``sys.exit(signum)`` as the SIGTERM handler (through this very function); a SIGTERM
    between it and the loop used to end a run with exit 15, no message and no checkpoint."""
    from ray._private.utils import set_sigterm_handler

    def ray_handler(signum, _frame):
        sys.exit(signum)

    with StopSignals(graceful=True) as stop:
        with keep_handlers():
            set_sigterm_handler(ray_handler)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested == signal.SIGTERM
        with pytest.raises(Interrupted) as info, keep_handlers():  # a SIGTERM inside ray.init itself
            set_sigterm_handler(ray_handler)
            os.kill(os.getpid(), signal.SIGTERM)
        assert info.value.signum == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) == stop._handle


def test_no_update_watch_and_numerics_warnings(caplog):
    caplog.set_level(logging.WARNING)
    watch = NoUpdateWatch(threshold=3)
    rows = [{"train/grad_norm": 0.5}, {"train/skipped_empty_batch": 1.0}, {"train/grad_norm": 0.0},
            {"train/skipped": 1.0, "train/grad_norm": float("inf")}, {"train/grad_norm": 0.1}]
    for step, m in enumerate(rows, start=1):
        watch.update(step, {**m, "rollout/reward_mean": 0.0})
    watch.summary()
    text = caplog.text
    assert "steps 2-4: 3 steps in a row changed no weight" in text
    assert "3 of 5 steps changed no weight (the longest run: 3 steps from step 2)" in text
    caplog.clear()
    warn_numerics(7, {"train/skipped": 1.0, "train/nonfinite_weights": 1.0, "tokens/nonfinite": 12.0,
                      "reward/failed_non_finite": 3.0})
    assert "step 7: optimizer step skipped (the update made the weights non-finite; rolled back)" in caplog.text
    assert "step 7: 12 response token(s) had non-finite" in caplog.text and "reward/failed_non_finite 3" in caplog.text


def test_failed_start_leaves_the_output_directory_alone(tmp_path, monkeypatch):
    from megatron_rl.preflight import load_run_config
    from megatron_rl.orchestration.run import Run

    a = quick_assets(tmp_path / "assets")
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("previous: run\n")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    cfg = load_run_config(TINY_RECIPE, tiny_overrides(a, out, "overwrite=true"))

    def no_ray(self):
        raise RuntimeError("Ray could not start")

    monkeypatch.setattr(Run, "_start_workers", no_ray)
    with pytest.raises(RuntimeError, match="Ray could not start"):
        Run(cfg).__enter__()
    assert (out / "config.yaml").read_text() == "previous: run\n"
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_overwrite_removes_every_output_of_the_earlier_run(tmp_path):
    """overwrite=true: no report/ or hf_final/ of the earlier run is left beside the new run's metrics."""
    from megatron_rl.preflight import load_run_config
    from megatron_rl.orchestration.run import Run

    a = quick_assets(tmp_path / "assets")
    out = tmp_path / "run"
    for sub in ("report", "hf_final", "tensorboard", "checkpoints/iter_0000001", "hf"):
        (out / sub).mkdir(parents=True)
        (out / sub / "f").write_text("old")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    run = Run.__new__(Run)  # only the output-directory step, no workers
    run.cfg = load_run_config(TINY_RECIPE, tiny_overrides(a, out, "overwrite=true"))
    run._prepare_output_dir()
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "hf"]  # hf/: a user's export, kept


def test_metrics_logger_reports_the_last_step_it_kept(tmp_path):
    from megatron_rl.config import LoggingConfig
    from megatron_rl.metrics import MetricsLogger

    cfg = LoggingConfig(output_dir=str(tmp_path), tensorboard=False)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)) + '{"step": 4')
    assert MetricsLogger(cfg, resume_step=2).last_step == 2  # step 3 (after the checkpoint) and a torn line cut
    assert MetricsLogger(cfg, resume_step=5).last_step == 2
    assert MetricsLogger(cfg).last_step is None


def test_manifest_names_the_damaged_file(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 1000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.bin").write_bytes(b"y" * 10)
    names = integrity.checkpoint_files(str(tmp_path))
    assert names == ["a.bin", "sub/b.bin"]
    integrity.write_manifest(str(tmp_path), integrity.describe(str(tmp_path), names))
    expected = integrity.read_manifest(str(tmp_path))
    assert integrity.checkpoint_files(str(tmp_path)) == names  # the manifest is not listed
    assert integrity.verify(str(tmp_path), expected, names) is None
    (tmp_path / "a.bin").write_bytes(b"x" * 999 + b"z")
    assert "a.bin fails its CRC-32 check" in integrity.verify(str(tmp_path), expected, names)
    (tmp_path / "a.bin").write_bytes(b"x" * 10)
    assert "a.bin has 10 bytes, the manifest says 1000 (truncated" in integrity.verify(str(tmp_path), expected, names)
    os.remove(tmp_path / "sub" / "b.bin")
    assert "b.bin is missing" in integrity.verify(str(tmp_path), expected, ["sub/b.bin"])
    (tmp_path / integrity.MANIFEST).write_text("{")
    with pytest.raises(integrity.CheckpointCorruptError, match="unreadable manifest"):
        integrity.read_manifest(str(tmp_path))
    assert integrity.read_manifest(str(tmp_path / "sub")) is None  # older checkpoints: nothing to check


def test_out_of_space_recognised_through_wrapping():
    import errno

    inner = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise inner
        except OSError as e:
            raise RuntimeError("write failed") from e
    except RuntimeError as outer:
        assert integrity.is_out_of_space(outer)
    assert integrity.is_out_of_space(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"))
    assert not integrity.is_out_of_space(RuntimeError("something else"))
    assert str(integrity.CheckpointSpaceError("no space left on /x")) == "no space left on /x"


def test_safetensors_problems(tmp_path):
    import torch
    from safetensors.torch import save_file

    from megatron_rl.preflight import safetensors_problem

    path = str(tmp_path / "m.safetensors")
    save_file({"w": torch.zeros(100)}, path)
    assert safetensors_problem(path) is None
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-50])
    assert f"has {len(data) - 50} bytes but its header describes {len(data)} (truncated)" in safetensors_problem(path)
    open(path, "wb").write(b"garbage!")
    assert "is not a readable safetensors file" in safetensors_problem(path)


def test_dead_actor_message_names_it_with_its_log(tmp_path):
    log = tmp_path / "worker-1.err"
    log.write_text(":job_id:01000000\n:actor_name:TrainerWorker\n" + "\n".join(f"line {i}" for i in range(40)) + "\n")
    err = RuntimeError("The actor died unexpectedly. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker "
                       "unexpectedly exits. End of file. Some common causes include: (1) the OOM killer\nmore")
    e = failures.actor_death("trainer rank 1", {"pid": 4242, "log": str(log)}, "train_step", err)
    text = str(e)
    assert text.splitlines()[0] == ("trainer rank 1 (pid 4242) died during train_step (Worker unexpectedly exits. "
                                    "End of file.)")
    assert f"its last log lines ({log}):" in text and "line 39" in text and "line 24" not in text
    assert ":job_id:" not in text  # Ray's markers are not log lines
    log.write_text(":job_id:01000000\n")
    assert str(failures.actor_death("engine 0", {"pid": 1, "log": str(log)}, "x", err)).endswith(f"its log ({log}) is empty")
    me = failures.identity()
    assert me["pid"] == os.getpid()
