"""Issue 28 items 4, 5 and 5b: resume finds the newest complete ``iter_*`` when the ``latest`` pointer is gone,
no new run truncates another's metrics.jsonl or starts over its checkpoints without ``--force``, one run per
output folder (a lock naming pid and host; a dead owner's lock is taken over), and a full disk's
``CheckpointSpaceError`` survives pickling (what Ray does to an actor's exception)."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys

import pytest

from megatron_rl.cli import main as cli_main
from megatron_rl.training import checkpoint as ck
from megatron_rl.training.checkpoint_integrity import MANIFEST, CheckpointSpaceError

from run_helpers import TINY_RECIPE, quick_assets, tiny_overrides


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return quick_assets(tmp_path_factory.mktemp("assets"))


def _checkpoints(root, *steps, manifest=True):
    for s in steps:
        os.makedirs(os.path.join(root, ck.iter_name(s)))
        if manifest:
            with open(os.path.join(root, ck.iter_name(s), MANIFEST), "w") as f:
                json.dump({}, f)


def test_latest_pointer_missing_or_a_directory_finds_the_newest_complete_checkpoint(tmp_path):
    root = str(tmp_path)
    _checkpoints(root, 2, 4)
    _checkpoints(root, 6, manifest=False)  # no manifest: not a complete checkpoint of this format
    os.makedirs(os.path.join(root, ".tmp_iter_0000008"))
    assert ck.latest_checkpoint(root) == os.path.join(root, "iter_0000004")
    os.makedirs(os.path.join(root, "latest"))
    assert ck.latest_checkpoint(root) == os.path.join(root, "iter_0000004")
    assert ck.latest_checkpoint(str(tmp_path / "none")) is None


def _dry_run(capsys, assets, out, *extra):
    rc = cli_main(["train", TINY_RECIPE, *tiny_overrides(assets, out), *extra, "--dry-run"])
    err = capsys.readouterr().err
    return rc, [line for line in err.splitlines() if "config error" in line or line.startswith("  - ")], err


def test_a_new_run_never_truncates_another_runs_metrics(assets, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    old = "".join(json.dumps({"step": s, "x": 1.0}) + "\n" for s in range(1, 9))
    (out / "metrics.jsonl").write_text(old)
    for extra in ([], ["resume=true"]):  # resume=true with nothing to resume used to start over (8 lines -> 1)
        rc, lines, err = _dry_run(capsys, assets, out, *extra)
        assert rc == 2 and len(lines) == 1, err[-2000:]
        assert "holds another run's metrics.jsonl (8 lines)" in lines[0] and "--force" in lines[0], lines
    assert cli_main(["train", TINY_RECIPE, *tiny_overrides(assets, out), "--force", "--dry-run"]) == 0
    assert "overwrite: true" in capsys.readouterr().out
    assert (out / "metrics.jsonl").read_text() == old  # a dry run deletes nothing


def test_resume_without_the_latest_pointer_passes_the_dry_run(assets, tmp_path, capsys):
    out = tmp_path / "run"
    _checkpoints(str(out / "checkpoints"), 2, 4)
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    rc, lines, err = _dry_run(capsys, assets, out, "resume=true")
    assert rc == 0, err[-2000:]
    os.makedirs(out / "checkpoints" / "latest")
    rc, lines, err = _dry_run(capsys, assets, out, "resume=true")
    assert rc == 2 and len(lines) == 1 and "latest is a directory" in lines[0], err[-2000:]


def test_lock_refuses_a_second_run_and_takes_over_a_dead_ones(tmp_path):
    from megatron_rl import run_dir

    out = str(tmp_path)
    release = run_dir.acquire(out)
    lock = json.loads(open(os.path.join(out, run_dir.LOCK_NAME)).read())
    assert lock["pid"] == os.getpid() and lock["host"] == socket.gethostname()
    # a second run (another process) on the same folder is refused, naming the owner
    probe = ("import sys; from megatron_rl import run_dir\n"
             "try:\n    run_dir.acquire(sys.argv[1])\nexcept run_dir.RunDirBusy as e:\n    print(e); sys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", probe, out], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert f"in use by another run (pid {os.getpid()} on host {socket.gethostname()!r}" in proc.stdout
    release()
    assert not os.path.exists(os.path.join(out, run_dir.LOCK_NAME))
    # a dead owner's lock (a killed driver) is stale: taken over
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(os.path.join(out, run_dir.LOCK_NAME), "w") as f:
        json.dump({"pid": dead.pid, "host": socket.gethostname(), "started": "1", "time": 0}, f)
    assert run_dir.busy_problem(out) is None
    release = run_dir.acquire(out)
    assert json.loads(open(os.path.join(out, run_dir.LOCK_NAME)).read())["pid"] == os.getpid()
    release()
    # a live pid whose start time differs is another process now (the pid was reused): stale too
    with open(os.path.join(out, run_dir.LOCK_NAME), "w") as f:
        json.dump({"pid": os.getppid(), "host": socket.gethostname(), "started": "-1", "time": 0}, f)
    assert run_dir.busy_problem(out) is None
    # another host's lock cannot be checked: refused, saying how to remove it
    with open(os.path.join(out, run_dir.LOCK_NAME), "w") as f:
        json.dump({"pid": 1, "host": "elsewhere", "time": 0}, f)
    assert "delete the lock file" in run_dir.busy_problem(out)
    with pytest.raises(run_dir.RunDirBusy, match="locked by a run of pid 1 on host 'elsewhere'"):
        run_dir.acquire(out)


def test_dry_run_refuses_an_output_folder_in_use(assets, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".megatron_rl.lock").write_text("{}")  # main: a lock file is nothing; here: a torn lock, no owner
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from megatron_rl import run_dir; "
                               "run_dir.acquire(sys.argv[1]); print('ok', flush=True); time.sleep(120)", str(out)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ok"
        rc, lines, err = _dry_run(capsys, assets, out)
        assert rc == 2 and len(lines) == 1 and f"in use by another run (pid {holder.pid}" in lines[0], err[-2000:]
    finally:
        holder.kill()
        holder.wait()
    rc, lines, err = _dry_run(capsys, assets, out)  # killed: its lock is stale
    assert rc == 0, err[-2000:]


def test_checkpoint_space_error_survives_pickling():
    e = pickle.loads(pickle.dumps(CheckpointSpaceError("checkpoint needs 5.0 GB in /x, 1.0 GB free")))
    assert type(e) is CheckpointSpaceError and str(e) == "checkpoint needs 5.0 GB in /x, 1.0 GB free"
    assert e.errno == 28


def test_weight_files_of_dead_writers_are_removed_and_live_ones_kept(tmp_path):
    from megatron_rl.rollout.client import weight_files

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert weight_files.file_prefix() == f"mrl-weights-{os.getpid()}-"
    names = {f"mrl-weights-{dead.pid}-abc.safetensors": False,  # a killed rank's: removed
             f"{weight_files.file_prefix()}def.safetensors": True,  # a live writer's (this process): kept
             "mrl-weights-xyz.safetensors": True,  # not named by a writer: not ours to judge
             f"other-{dead.pid}-abc.safetensors": True}
    for name in names:
        (tmp_path / name).write_bytes(b"x" * 1000)
    removed = weight_files.remove_stale(str(tmp_path))
    assert removed == [str(tmp_path / f"mrl-weights-{dead.pid}-abc.safetensors")]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n, kept in names.items() if kept)


def test_checkpoint_space_error_crosses_ray_as_its_one_line():
    """A full disk in a trainer rank (a Ray actor) reaches the driver as the CLI's one line, not Ray's
    ``UnserializableException`` (the error could not be unpickled on main)."""
    import ray

    from megatron_rl.orchestration.failures import from_ray_error

    class Rank:
        def save(self):
            raise CheckpointSpaceError("checkpoint needs 5.0 GB in /ckpt but 1.0 GB are free; free space")

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        rank = ray.remote(Rank).options(num_cpus=0).remote()
        with pytest.raises(ray.exceptions.RayTaskError) as caught:
            ray.get(rank.save.remote(), timeout=120)
        error = from_ray_error(caught.value)
        assert error is not None and str(error) == ("checkpoint needs 5.0 GB in /ckpt but 1.0 GB are free; "
                                                    "free space")
    finally:
        ray.shutdown()
