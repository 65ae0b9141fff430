"""Issue 28 item 6: a SIGKILL'd driver leaves no process of its run behind, deterministically -- also a child it
started with a clean environment and no file in Ray's session directory (found only through the driver's
recorded process tree), and a process that keeps forking while the guard sweeps (frozen before it is killed,
so no child escapes by being born after the scan)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard reads /proc (Linux)")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def test_killed_driver_leaves_no_process_behind(tmp_path):
    pids_file = tmp_path / "forked"
    forker_py = tmp_path / "forker.py"  # forks a child every 20 ms (up to 500)
    forker_py.write_text("import os, sys, time\nout = open(sys.argv[1], 'a')\nfor _ in range(500):\n    pid = os.fork()\n"
                         "    if pid == 0:\n        time.sleep(600)\n        os._exit(0)\n"
                         "    out.write(f'{pid}\\n'); out.flush()\n    time.sleep(0.02)\n")
    driver = textwrap.dedent(f"""
        import os, subprocess, sys, time
        from megatron_rl.orchestration.ray_guard import Guard, ENV
        g = Guard()
        g.watch({str(tmp_path / 'session')!r})
        clean = {{k: v for k, v in os.environ.items() if k != ENV}}
        quiet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=clean, cwd="/")
        forker = subprocess.Popen([sys.executable, {str(forker_py)!r}, {str(pids_file)!r}], env=clean, cwd="/")
        print(quiet.pid, forker.pid, g.proc.pid, flush=True)
        time.sleep(600)
    """)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    try:
        quiet, forker, guard = map(int, proc.stdout.readline().split())
        time.sleep(2.5)  # the guard records the tree (every 1 s); the forker forks ~50 children a second
        assert all(_alive(p) for p in (quiet, forker, guard))
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _alive(guard):
            time.sleep(0.1)
        assert not _alive(guard), "the guard did not finish its sweep"
        forked = [int(x) for x in pids_file.read_text().split()]
        assert len(forked) > 10
        left = [p for p in (quiet, forker, *forked) if _alive(p)]
        assert not left, f"{len(left)} of the run's processes outlived the driver: {left[:10]}"
        assert _alive(bystander.pid)
    finally:
        bystander.kill()
        proc.kill()
        stray = [locals().get("quiet"), locals().get("forker")]
        stray += [int(x) for x in pids_file.read_text().split()] if pids_file.exists() else []
        for p in stray:  # where the guard failed: leave nothing running on the test machine
            if p and _alive(p):
                try:
                    os.kill(p, 9)
                except OSError:
                    pass
