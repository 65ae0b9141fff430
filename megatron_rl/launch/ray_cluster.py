"""Ray cluster helpers for multi-node launches.

* :func:`wait_for_cluster` polls ``ray.nodes()`` until the expected nodes - with their GPUs/CPUs and
  their ``slurm_node:<name>`` tag resources - are alive, and otherwise raises naming what is missing,
  so a multi-node job fails in minutes with a reason instead of hanging in the first collective.
* :func:`find_cluster_processes` / :func:`reap` find and stop the processes of *one* Ray cluster, by
  its temp dir: ``ray stop`` would kill every Ray process on the machine (other jobs' clusters
  included), and ``pkill -f ray`` even more. Ray workers rename themselves (``ray::IDLE``), so the
  temp dir is looked for in the command line *and* in the open files (their logs live there).

Command line (used by the sbatch template, inside the job)::

    python -m megatron_rl.launch.ray_cluster wait --address IP:PORT --nodes 2 --per-node GPU=8 \
        --tag slurm_node:n1 --tag slurm_node:n2 --timeout 600
    MEGATRON_RL_RAY_TMP=/tmp/ray-j1234 python -m megatron_rl.launch.ray_cluster reap
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple


def cluster_shortfall(nodes: Sequence[Mapping], num_nodes: int, per_node: Optional[Mapping[str, float]] = None,
                      tags: Sequence[str] = ()) -> List[str]:
    """What keeps ``nodes`` (the output of ``ray.nodes()``) from being the expected cluster.

    Expected: at least ``num_nodes`` alive nodes, each offering at least ``per_node`` resources
    (e.g. ``{"GPU": 8}``), and every resource name in ``tags`` offered by some alive node.
    Returns human-readable problems; empty when the cluster is complete.
    """
    alive = [n for n in nodes if n.get("Alive")]
    problems = []
    if len(alive) < num_nodes:
        problems.append(f"{len(alive)} of {num_nodes} nodes joined")
    for tag in tags:
        if not any(tag in n.get("Resources", {}) for n in alive):
            problems.append(f"no node with resource {tag!r} (that node's Ray did not join; see its log)")
    for n in alive:
        res = n.get("Resources", {})
        short = {k: (res.get(k, 0), v) for k, v in (per_node or {}).items() if res.get(k, 0) < v}
        if short:
            name = next((k.split(":", 1)[1] for k in res if k.startswith("slurm_node:")), None)
            where = f"node {name} ({n.get('NodeManagerAddress')})" if name else f"node {n.get('NodeManagerAddress')}"
            have = ", ".join(f"{k}={got:g} (expected {want:g})" for k, (got, want) in short.items())
            problems.append(f"{where} offers {have}")
    return problems


def wait_for_cluster(num_nodes: int, *, per_node: Optional[Mapping[str, float]] = None, tags: Sequence[str] = (),
                     timeout_s: float = 300.0, poll_s: float = 1.0) -> List[Dict]:
    """Block until the connected Ray cluster is complete (see :func:`cluster_shortfall`).

    Call after ``ray.init(address=...)``. Returns the alive nodes; raises ``TimeoutError`` naming
    what is still missing after ``timeout_s`` seconds.
    """
    import ray

    if num_nodes < 1:
        raise ValueError(f"num_nodes={num_nodes}: expected at least 1")
    if not ray.is_initialized():
        raise RuntimeError("wait_for_cluster: call ray.init(address=...) first")
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = ray.nodes()
        problems = cluster_shortfall(nodes, num_nodes, per_node, tags)
        if not problems:
            return [n for n in nodes if n.get("Alive")]
        if time.monotonic() >= deadline:
            raise TimeoutError(f"Ray cluster incomplete after {timeout_s:g} s: " + "; ".join(problems))
        time.sleep(poll_s)


def _mentions(text: str, paths: Sequence[str]) -> bool:
    # "/tmp/ray-j12" must not match "/tmp/ray-j123": the next character may not continue the name.
    return any(re.search(re.escape(p) + r"(?![\w.-])", text) for p in paths)


def find_cluster_processes(temp_dir: str) -> List[Tuple[int, str]]:
    """``(pid, command)`` of this user's processes that belong to the Ray cluster using ``temp_dir``.

    A process belongs to it when its command line or one of its open files names ``temp_dir``
    (raylet/GCS get ``--session_dir=...``; workers keep their logs there open). Linux only.
    """
    # as written on command lines, and as open files show it (symlinks resolved)
    paths = {os.path.normpath(temp_dir), os.path.realpath(temp_dir)}
    me, uid = os.getpid(), os.getuid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            hit = _mentions(cmd, paths)
            if not hit:
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    try:
                        if _mentions(os.readlink(f"/proc/{pid}/fd/{fd}"), paths):
                            hit = True
                            break
                    except OSError:
                        continue
        except (OSError, ValueError):  # exited meanwhile, or not ours to inspect
            continue
        if hit:
            found.append((pid, cmd or f"[pid {pid}]"))
    return found


def reap(temp_dir: str, grace_s: float = 5.0) -> Tuple[List[Tuple[int, str]], List[int]]:
    """Stop the processes of the Ray cluster using ``temp_dir``.

    SIGTERM goes to the outermost ones first (``ray start --block`` stops the processes it started
    on SIGTERM); whatever is left after ``grace_s`` gets SIGTERM, then SIGKILL. Returns the
    processes found and the pids that outlived the first round (normally none).
    """
    procs = find_cluster_processes(temp_dir)
    pids = {pid for pid, _ in procs}
    roots = [pid for pid in pids if _ppid(pid) not in pids]
    forced: List[int] = []
    for round_, (sig, wait_s) in enumerate(((signal.SIGTERM, grace_s), (signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0))):
        targets = roots if round_ == 0 else [pid for pid in pids if _running(pid)]
        if round_ == 1:
            forced = targets
        for pid in targets:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not any(_running(pid) for pid in pids):
            break
    return procs, forced


def _stat_fields(pid: int) -> List[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # [state, ppid, ...]; the name may hold spaces


def _ppid(pid: int) -> int:
    try:
        return int(_stat_fields(pid)[1])
    except (OSError, IndexError, ValueError):
        return 0


def _running(pid: int) -> bool:
    try:
        return _stat_fields(pid)[0] != "Z"
    except OSError:
        return False


def _parse_resources(items: Sequence[str]) -> Dict[str, float]:
    out = {}
    for item in items:
        key, _, val = item.partition("=")
        try:
            if not key:
                raise ValueError
            out[key] = float(val)
        except ValueError:
            raise SystemExit(f"--per-node {item!r}: expected NAME=NUMBER, e.g. GPU=8") from None
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_rl.launch.ray_cluster")
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wait", help="wait until all nodes (and their GPUs/CPUs) joined the cluster")
    w.add_argument("--address", required=True, help="GCS address IP:PORT of the head")
    w.add_argument("--nodes", type=int, required=True)
    w.add_argument("--per-node", action="append", default=[], metavar="NAME=N", help="e.g. GPU=8 (repeat)")
    w.add_argument("--tag", action="append", default=[], help="a resource some node must offer (repeat)")
    w.add_argument("--timeout", type=float, default=300.0)
    r = sub.add_parser("reap", help="stop the processes of the Ray cluster using this temp dir")
    r.add_argument("--temp-dir", default=os.environ.get("MEGATRON_RL_RAY_TMP"),
                   help="the cluster's Ray temp dir (default: $MEGATRON_RL_RAY_TMP, set by the sbatch script; "
                        "an environment variable keeps it out of the launching srun's own command line)")
    r.add_argument("--grace", type=float, default=5.0)
    args = ap.parse_args(argv)

    if args.cmd == "reap":
        if not args.temp_dir:
            ap.error("reap: pass --temp-dir or set MEGATRON_RL_RAY_TMP")
        procs, forced = reap(args.temp_dir, args.grace)
        names = dict(procs)
        print(f"[ray_cluster] {os.uname().nodename}: stopped {len(procs)} processes using {args.temp_dir}"
              + (f"; {len(forced)} outlived ray start's own shutdown: "
                 + ", ".join(f"{p} ({names[p][:60]})" for p in forced) if forced else ""), flush=True)
        return 0

    import ray

    per_node = _parse_resources(args.per_node)
    t0 = time.monotonic()
    ray.init(address=args.address, logging_level="warning", log_to_driver=False)
    try:
        nodes = wait_for_cluster(args.nodes, per_node=per_node, tags=args.tag, timeout_s=args.timeout)
    except TimeoutError as e:
        print(f"[ray_cluster] ERROR: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        ray.shutdown()
    total = {}
    for n in nodes:
        for k in ("CPU", "GPU"):
            total[k] = total.get(k, 0) + n["Resources"].get(k, 0)
    print(f"[ray_cluster] {len(nodes)} nodes joined in {time.monotonic() - t0:.1f} s "
          f"(CPU={total['CPU']:g}, GPU={total['GPU']:g})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
