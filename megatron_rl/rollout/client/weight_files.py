"""Weight files in shared memory (``/dev/shm/mrl-weights-*``) named so that leftovers can be found and removed.

A trainer rank writes each bucket to a file, the engine reads it, the rank removes it. A rank killed between
write and removal leaves the file (up to the bucket size, 512 MB in real runs, in RAM) and nothing else would
ever remove it. So the name carries the writer's pid (``mrl-weights-<pid>-<random>.safetensors``), and the
driver removes, at start and after its workers stopped, every such file of this user whose writer is dead.
A live process's file is never touched (another run's, or a rank still writing)."""

from __future__ import annotations

import logging
import os
import re
from typing import List, Optional

from megatron_rl.rollout.client import wire
from megatron_rl.pids import pid_alive

logger = logging.getLogger(__name__)
_NAME = re.compile(re.escape(wire.WEIGHT_FILE_PREFIX) + r"(\d+)-.*\.safetensors$")


def file_prefix() -> str:
    """The prefix of this process's weight files (``tempfile.mkstemp(prefix=...)``)."""
    return f"{wire.WEIGHT_FILE_PREFIX}{os.getpid()}-"


def remove_stale(directory: Optional[str] = None) -> List[str]:
    """Remove this user's weight files in ``directory`` (default: where they are written) whose writer process
    is gone; returns their paths."""
    directory = directory or wire.shared_dir()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _NAME.match(name)
        if not m or pid_alive(int(m.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
            size = os.lstat(path).st_size
            os.remove(path)
        except OSError:
            continue
        removed.append(path)
        logger.info("removed %s (%d bytes), a weight file of a process that is gone", path, size)
    return removed
