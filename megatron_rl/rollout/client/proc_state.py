"""Stopped processes, read from ``/proc`` (Linux; elsewhere nothing is ever seen stopped).

A server process stopped by SIGSTOP is neither dead nor answering: its exit status says it
runs, and every call to it waits for its timeout. Engine recovery reads the state of the server's process
group instead (``T``: stopped by a signal), which costs no request to the engine and works while the driver holds
the engines (memory released, weight sync) and ``/health`` is not asked. A process stopped by a tracer (``t``: a
debugger, py-spy) is someone's deliberate inspection, not a fault: it is not reported.
"""

from __future__ import annotations

import os
from typing import List

STOPPED_STATES = ("T",)
STOPPED = "is stopped (SIGSTOP)"  # how an engine's exit status names a stopped server


def _stat(pid: str):
    """(state, process group) of ``pid``, or None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
        return fields[0], int(fields[2])
    except (OSError, IndexError, ValueError):
        return None


def stopped_in_group(pgid: int) -> List[int]:
    """The processes of process group ``pgid`` stopped by a signal (sorted pids); [] if none or no ``/proc``."""
    if not os.path.isdir("/proc"):
        return []
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            stat = _stat(pid)
            if stat is not None and stat[1] == pgid and stat[0] in STOPPED_STATES:
                out.append(int(pid))
    return sorted(out)
