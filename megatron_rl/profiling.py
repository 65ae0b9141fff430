"""torch-profiler traces of chosen steps (``profile.steps``) on chosen trainer ranks and engines.

For each step in ``profile.steps`` the driver starts a capture before the step's first phase and stops it
after its last (weight sync, evaluation and checkpoint included). Output, one Chrome trace per process
(open in Perfetto or ``chrome://tracing``)::

    <profile.dir or <output_dir>/profile>/step_<N>/trainer_rank<R>.json
    <...>/step_<N>/engine<i>/              the engine server's /start_profile output (SGLang's traces; the
                                           embedded server: embedded-TP-0.trace.json, its process, all threads)

Remote engines (``rollout.engine: remote``) are not profiled (their processes are not ours).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from megatron_rl.config.sections import ProfileConfig  # noqa: F401 - its home before config/sections.py




class Capture:
    """One torch-profiler session in this process (CPU, and CUDA when present; every thread)."""

    def __init__(self) -> None:
        self._prof = None
        self._path: Optional[str] = None

    def start(self, path: str, record_shapes: bool = False, with_stack: bool = False) -> None:
        from torch.profiler import ProfilerActivity, profile

        if self._prof is not None:
            self.stop()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        kw = dict(activities=activities, record_shapes=record_shapes, with_stack=with_stack)
        try:  # servers generate on their own threads: record all of them (torch >= 2.7)
            from torch._C._profiler import _ExperimentalConfig

            self._prof = profile(**kw, experimental_config=_ExperimentalConfig(profile_all_threads=True))
        except (ImportError, TypeError):
            self._prof = profile(**kw)
        self._path = path
        self._prof.start()

    def stop(self) -> Optional[str]:
        """Stop and write the trace; returns its path (None when nothing was running)."""
        if self._prof is None:
            return None
        prof, path = self._prof, self._path
        self._prof = self._path = None
        prof.stop()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        prof.export_chrome_trace(path)
        return path
