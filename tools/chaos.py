"""Reliability replay of the tiny recipe (issue 16): bad inputs and injected faults, counted.

    python tools/chaos.py [--inputs] [--faults] [--stalls] [--work DIR]

* **Bad inputs** (:data:`BAD_INPUTS`, in-process ``megatron-rl train ... --dry-run``, or a real start where only
  a run can tell): each must end with exit 2 and one line per problem naming the field or file, no traceback,
  and must leave the output directory of a previous run as it was (``config.yaml``, ``metrics.jsonl``).
* **Faults** (:func:`fault_chain`): one uninterrupted reference run and one run taken through a chain of faults —
  kill -9 of a trainer rank, SIGTERM with ``checkpoint.on_signal``, kill -9 of the driver between committing a
  checkpoint and writing its metrics line, SIGTERM, a damaged newest checkpoint, each followed by
  ``resume=true``, and kill -9 of the rollout engine's server, which the run itself recovers (engine recovery:
  restart, weights, probe check) and finishes; every metrics line (timings and the recovery's own counters
  excluded) must equal the reference's. Also:
  every listening socket of the run's processes is on the loopback interface, and no process of a run outlives
  a SIGKILL'd driver by more than a few seconds.
* **Stalls** (:func:`stall_faults`, issue 28): the engine server SIGSTOPped while the driver holds the engines
  (memory released) is detected within ``rollout.control_timeout_s`` and recovered in the run; a SIGSTOPped trainer
  rank is named in a warning within ``cluster.stall_warn_s``, stops the run with one line after
  ``cluster.stall_fail_s``, and ``resume=true`` ends with the uninterrupted run's metrics.
* Further bad-input classes register in :data:`INPUT_CLASSES` and are counted the same way, summed in one table;
  ``rollout server``: ``tools/chaos_server.py``'s requests against one embedded server (issue 28).

Prints markdown tables and writes ``bench_results/chaos.json``. ``tests/e2e/test_reliability.py`` runs both.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling modules below (tools/ is no package)

from chaos_inputs import (  # noqa: E402,F401  (re-exported: tests/e2e/test_reliability.py reads them here)
    BAD_INPUTS, INPUT_CLASSES, Case, InputResult, _chaos_server, _print_inputs, _truncate, bad_inputs,
    check_input, input_counts, print_input_summary, server_inputs,
)
from chaos_run import (  # noqa: E402,F401
    NOT_COMPARED, RECIPE, REPO, Run, alive, assets, descendants, env, is_loopback, listening_sockets, metric_differences,
    metrics, overrides,
)

# ---------------------------------------------------------------------------------------------------------
# faults
# ---------------------------------------------------------------------------------------------------------


@dataclass
class FaultResult:
    fault: str
    exit_code: Optional[int]
    survived: bool  # a clear message, the expected exit code, and the next resume went on from a checkpoint
    detail: str = ""
    seconds_to_exit: Optional[float] = None


@dataclass
class ChainResult:
    faults: List[FaultResult] = field(default_factory=list)
    metrics_equal: bool = False
    differences: List[str] = field(default_factory=list)
    sockets: List[str] = field(default_factory=list)
    non_loopback: List[str] = field(default_factory=list)
    lingering_after_kill: List[str] = field(default_factory=list)


def _victim(run: Run, pattern: str) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = [p for p, cmd in sorted(run.descendants().items()) if pattern in cmd]
        if found:
            return found[-1] if pattern == "TrainerWorker" else found[0]  # the last rank, the first engine (server)
        time.sleep(0.2)
    raise RuntimeError(f"no {pattern} process under the driver")


def _kill(run: Run, pid: int, sig: int) -> float:
    os.kill(pid, sig)
    start = time.monotonic()
    run.wait()
    return time.monotonic() - start


def fault_chain(work: str, a: Dict[str, str], steps: int = 6, log: Callable[[str], None] = print) -> ChainResult:
    """A reference run, then the same run through a chain of faults (see the module docstring)."""
    res = ChainResult()
    common = ["checkpoint.interval=2", "checkpoint.keep_last=0"]
    ref_out, out = os.path.join(work, "reference"), os.path.join(work, "faulted")
    for d in (ref_out, out):
        shutil.rmtree(d, ignore_errors=True)
    os.makedirs(work, exist_ok=True)

    ref = Run(overrides(a, ref_out, *common, steps=steps), os.path.join(work, "reference.log"))
    ref.wait_for(r"step 1/")
    pids = list(ref.descendants()) + [ref.proc.pid]
    res.sockets = listening_sockets(pids)
    res.non_loopback = [s for s in res.sockets if not is_loopback(s)]
    if ref.wait() != 0:
        raise RuntimeError(f"the reference run failed: see {ref.log_path}")
    log(f"reference run done; {len(res.sockets)} listening sockets, non-loopback: {res.non_loopback}")

    def segment(name: str, *extra: str, env_: Optional[Dict[str, str]] = None) -> Run:
        resume = ["resume=true"] if os.path.isdir(os.path.join(out, "checkpoints")) else []
        return Run(overrides(a, out, *common, *resume, *extra, steps=steps), os.path.join(work, f"{name}.log"), env_)

    def record(fault: str, run: Run, code: Optional[int], want_code, pattern: str, seconds=None) -> None:
        text = run.text()
        found = re.search(pattern, text, re.M)
        ok = (code in want_code) and bool(found)
        ok = ok and "Traceback (most recent call last)" not in text.split("megatron-rl train:")[-1]
        line = next((x for x in text.splitlines() if x.startswith("megatron-rl train:")), found[0] if found else "")
        res.faults.append(FaultResult(fault, code, ok, line[:400], seconds))
        log(f"{fault}: exit {code}, {'ok' if ok else 'NOT OK'}: {line[:200]}")

    # 1. kill -9 of a trainer rank (after the checkpoint of step 2)
    run = segment("1_rank")
    run.wait_for(r"step 2/")
    secs = _kill(run, _victim(run, "TrainerWorker"), signal.SIGKILL)
    record("kill -9 trainer rank", run, run.proc.returncode, (1,),
           r"failed: trainer rank \d \(pid \d+\) died during \w+", secs)

    # 2. SIGTERM with checkpoint.on_signal: the step in flight finishes and is checkpointed (3: off the interval)
    run = segment("2_sigterm_checkpoint", "checkpoint.on_signal=true")
    run.wait_for(r"resumed from .* at step 2")
    secs = _kill(run, run.proc.pid, signal.SIGTERM)
    record("SIGTERM, checkpoint.on_signal=true", run, run.proc.returncode, (128 + signal.SIGTERM,),
           r"stopped by SIGTERM; checkpointed step 3 first", secs)

    # 3. kill -9 of the driver between committing checkpoint 4 and writing its metrics line; its Ray must go too
    run = segment("3_driver", env_={"MEGATRON_RL_FAULT": "after_checkpoint:4"})
    run.wait_for(r"resumed from .* at step 3")
    tree = run.descendants()
    code = run.wait()
    tree.update(descendants(run.proc.pid))
    time.sleep(10)  # the guard acts at once; Ray's agents would otherwise stay ~90 s
    res.lingering_after_kill = [f"{p} {tree.get(p, '')[:60]}" for p in alive(tree)]
    record("kill -9 driver mid-commit", run, code, (-signal.SIGKILL,), r"step 4: checkpoint")

    # 4. plain SIGTERM (stops at once; resume from the latest checkpoint, 4)
    run = segment("4_sigterm")
    run.wait_for(r"step 5/")
    secs = _kill(run, run.proc.pid, signal.SIGTERM)
    record("SIGTERM", run, run.proc.returncode, (128 + signal.SIGTERM,),
           r"stopped by SIGTERM; resume=true continues from the latest checkpoint", secs)
    replayed = "step 4's metrics line was lost with the interrupted run" in run.text()
    res.faults[-2].survived &= replayed  # the mid-commit kill lost no metrics line

    # 5. the newest checkpoint damaged: the resume falls back to the one before (3), with a warning
    ckpt = os.path.join(out, "checkpoints", "iter_0000004")
    shard = sorted(f for f in os.listdir(ckpt) if f.endswith(".distcp"))[0]
    _truncate(os.path.join(ckpt, shard))
    run = segment("5_damaged_then_engine")
    fell_back = run.wait_for(r"iter_0000004 is damaged.*resuming from iter_0000003")
    # ... and in the same run: kill -9 of the rollout engine's server (not its EngineWorker actor: a lost actor is
    # not replaced, engine_health.py). Engine recovery restarts it with the trainer's weights; the seeded requests
    # it had are re-sent, so the run goes on to the end with the uninterrupted run's samples.
    run.wait_for(r"step 4/")
    os.kill(_victim(run, "megatron_rl.rollout.embedded.server"), signal.SIGKILL)
    code = run.wait()
    res.faults.append(FaultResult("damaged newest checkpoint", None, fell_back, "fell back to iter_0000003"))
    record("kill -9 rollout engine (recovered)", run, code, (0,), r"engine 0 back in rotation after .*")

    # 6. finish, if the run above did not
    if code != 0:
        run = segment("6_finish")
        code = run.wait()
    if code != 0:
        raise RuntimeError(f"the last segment failed (exit {code}): see {run.log_path}")
    res.differences = metric_differences(metrics(ref_out), metrics(out))
    res.metrics_equal = not res.differences
    log(f"metrics equal to the reference: {res.metrics_equal} {res.differences[:5]}")
    return res


# ---------------------------------------------------------------------------------------------------------
# stalls (issue 28): a stopped engine during a hold, a stopped trainer rank
# ---------------------------------------------------------------------------------------------------------

STALL_BOUNDS = dict(control_timeout_s=20.0, stall_warn_s=8.0, stall_fail_s=24.0)  # small, for a short replay


@dataclass
class StallResult:
    faults: List[FaultResult] = field(default_factory=list)
    engine_detect_s: Optional[float] = None  # SIGSTOP of the engine -> the monitor kills it (bound: control_timeout_s)
    rank_warn_s: Optional[float] = None  # SIGSTOP of a trainer rank -> the warning naming it (bound: stall_warn_s)
    rank_fail_s: Optional[float] = None  # ... -> the run's one-line error (bound: stall_fail_s)
    warning: str = ""
    metrics_equal: bool = False
    differences: List[str] = field(default_factory=list)


def _seconds_until(run: Run, pattern: str, start: float, timeout: float) -> Optional[float]:
    """Seconds from ``start`` (monotonic) until ``pattern`` is in the run's log; None if the run ended first."""
    return time.monotonic() - start if run.wait_for(pattern, timeout) else None


def stall_faults(work: str, a: Dict[str, str], steps: int = 2, log: Callable[[str], None] = print,
                 bounds: Dict[str, float] = STALL_BOUNDS) -> StallResult:
    """A reference run, then one run in which (1) the engine server is SIGSTOPped right after the driver released
    its memory (a hold: no ``/health``) in step 1 -- it must be detected within ``rollout.control_timeout_s``,
    killed, restarted and re-synced, and the run goes on -- and (2) the last trainer rank is SIGSTOPped during step
    2: a warning naming it within ``cluster.stall_warn_s``, one clear error after ``cluster.stall_fail_s``; then
    ``resume=true`` finishes. Its metrics must equal the reference's (engine/ and timings excluded)."""
    res = StallResult()
    common = ["checkpoint.interval=1", "checkpoint.keep_last=0",
              f"rollout.control_timeout_s={bounds['control_timeout_s']}",
              f"cluster.stall_warn_s={bounds['stall_warn_s']}", f"cluster.stall_fail_s={bounds['stall_fail_s']}"]
    ref_out, out = os.path.join(work, "stall_reference"), os.path.join(work, "stalled")
    for d in (ref_out, out):
        shutil.rmtree(d, ignore_errors=True)
    os.makedirs(work, exist_ok=True)
    ref = Run(overrides(a, ref_out, *common, steps=steps), os.path.join(work, "stall_reference.log"))
    if ref.wait() != 0:
        raise RuntimeError(f"the reference run failed: see {ref.log_path}")

    run = Run(overrides(a, out, *common, steps=steps), os.path.join(work, "stall_1.log"),
              {"MEGATRON_RL_TEST_STOP_ENGINE": "1"})  # tests/fault_hooks.py: SIGSTOP at the 1st memory release
    run.wait_for(r"fault injection: SIGSTOP to the engine server")
    t0 = time.monotonic()
    res.engine_detect_s = _seconds_until(run, r"engine 0 .*is stopped .*killing it", t0, 300)
    back = run.wait_for(r"engine 0 back in rotation", 600)
    ok = back and res.engine_detect_s is not None and res.engine_detect_s <= bounds["control_timeout_s"]
    res.faults.append(FaultResult("SIGSTOP engine while its memory is released (recovered)", None, ok,
                                  f"detected in {res.engine_detect_s} s; back in rotation: {back}"))
    log(f"engine SIGSTOP during a hold: detected in {res.engine_detect_s} s, recovered: {back}")

    run.wait_for(r"^.*step 1/")  # step 1 is checkpointed: stop the last trainer rank during step 2
    victim = _victim(run, "TrainerWorker")
    os.kill(victim, signal.SIGSTOP)
    t0 = time.monotonic()
    res.rank_warn_s = _seconds_until(run, rf"trainer rank \d \(node .*, pid {victim}\) has been silent", t0, 300)
    res.warning = next((x for x in run.text().splitlines() if "has been silent" in x), "")
    code = run.wait(600)
    res.rank_fail_s = time.monotonic() - t0
    record_ok = (code == 1 and res.rank_warn_s is not None and res.rank_warn_s <= bounds["stall_warn_s"] + 5
                 and bounds["stall_fail_s"] <= res.rank_fail_s)
    line = next((x for x in run.text().splitlines() if x.startswith("megatron-rl train:")), "")
    record_ok &= bool(re.search(rf"failed: trainer rank \d \(node .*, pid {victim}\) has been silent for \d+ s "
                                r"\(last phase: \w+\) >= cluster.stall_fail_s.*resume=true continues from the latest "
                                r"checkpoint, .*iter_0000001", line))
    record_ok &= "Traceback (most recent call last)" not in run.text().split("megatron-rl train:")[-1]
    res.faults.append(FaultResult("SIGSTOP trainer rank (warned, stopped, resumed)", code, record_ok, line[:400],
                                  res.rank_fail_s))
    log(f"trainer rank SIGSTOP: warned after {res.rank_warn_s} s, run ended (exit {code}) after "
        f"{res.rank_fail_s:.1f} s: {line[:200]}")

    resumed = Run(overrides(a, out, *common, "resume=true", steps=steps), os.path.join(work, "stall_2.log"))
    if resumed.wait() != 0:
        raise RuntimeError(f"the resumed run failed: see {resumed.log_path}")
    res.differences = metric_differences(metrics(ref_out), metrics(out))
    res.metrics_equal = not res.differences
    log(f"metrics equal to the reference: {res.metrics_equal} {res.differences[:5]}")
    return res


# ---------------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", action="store_true", help="only the bad inputs")
    ap.add_argument("--faults", action="store_true", help="only the fault chain")
    ap.add_argument("--stalls", action="store_true", help="only the stall faults (stopped engine, stopped rank)")
    ap.add_argument("--work", default="runs/chaos", help="working directory (deleted first)")
    args = ap.parse_args()
    both = not (args.inputs or args.faults or args.stalls)
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    a = assets(os.path.join(args.work, "assets"))
    report: Dict[str, object] = {}
    if both or args.inputs:
        results = bad_inputs(os.path.join(args.work, "inputs"), a)
        per_class = {"config, data, files": _print_inputs("config, data, files", results)}
        report["inputs"] = dict(counts=per_class["config, data, files"], cases=[asdict(r) for r in results])
        for name, fn in INPUT_CLASSES.items():
            res = fn(os.path.join(args.work, re.sub(r"\W+", "_", name)), a)
            per_class[name] = _print_inputs(name, res)
            report[name] = dict(counts=per_class[name], cases=[asdict(r) for r in res])
        report["input_counts"] = dict(per_class, all=print_input_summary(per_class))
    if both or args.faults:
        chain = fault_chain(os.path.join(args.work, "faults"), a)
        print("| fault | exit | survived | seconds to exit | message |\n|---|---|---|---|---|")
        for f in chain.faults:
            secs = "" if f.seconds_to_exit is None else f"{f.seconds_to_exit:.1f}"
            print(f"| {f.fault} | {f.exit_code} | {'yes' if f.survived else 'NO'} | {secs} | {f.detail[:120]} |")
        survived = sum(f.survived for f in chain.faults)
        print(f"\nfaults tried / survived / metrics equal after resume: {len(chain.faults)} / {survived} / "
              f"{'yes' if chain.metrics_equal else 'NO'}; listening sockets {len(chain.sockets)}, non-loopback "
              f"{chain.non_loopback}; processes alive 10 s after the driver's kill -9: {chain.lingering_after_kill}")
        report["faults"] = asdict(chain)
    if both or args.stalls:
        st = stall_faults(os.path.join(args.work, "stalls"), a)
        print("| stall fault | exit | survived | seconds | detail |\n|---|---|---|---|---|")
        for f in st.faults:
            secs = "" if f.seconds_to_exit is None else f"{f.seconds_to_exit:.1f}"
            print(f"| {f.fault} | {f.exit_code} | {'yes' if f.survived else 'NO'} | {secs} | {f.detail[:120]} |")
        print(f"\nstall faults tried / survived / metrics equal after resume: {len(st.faults)} / "
              f"{sum(f.survived for f in st.faults)} / {'yes' if st.metrics_equal else 'NO'}; engine detected in "
              f"{st.engine_detect_s} s (bound {STALL_BOUNDS['control_timeout_s']:g}), rank warned in "
              f"{st.rank_warn_s} s "
              f"(bound {STALL_BOUNDS['stall_warn_s']:g}), run stopped after {st.rank_fail_s} s (bound "
              f"{STALL_BOUNDS['stall_fail_s']:g})")
        report["stalls"] = asdict(st)
    os.makedirs(os.path.join(REPO, "bench_results"), exist_ok=True)
    with open(os.path.join(REPO, "bench_results", "chaos.json"), "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
