"""Checkpoint integrity and disk space (used by ``checkpoint.py``; the file-level helpers need no
torch.distributed, the collective ones spread the reading over the ranks and agree on one outcome).

* A manifest (``manifest.json``: every file's size and CRC-32) is written into each checkpoint before it
  is committed and checked before it is loaded. A torn or flipped file otherwise surfaces deep inside
  ``torch.load`` / dist-checkpointing as a bare ``EOFError`` or a shape error that names no file; here it
  is named with its step, and the loader falls back to the newest intact checkpoint.
* A save first compares the space it needs (the previous checkpoint's size, else an estimate from the
  state) with what the file system has free, so a full disk is reported as such before anything is
  written, instead of torch's ``[enforce fail at inline_container.cc] unexpected pos``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import zlib
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch.distributed as dist
from megatron.core import dist_checkpointing

MANIFEST = "manifest.json"
_CHUNK = 8 * 2**20


class CheckpointCorruptError(ValueError):
    """A checkpoint's files do not match its manifest (or cannot be read)."""


class CheckpointMismatchError(ValueError):
    """A checkpoint that cannot be loaded into this trainer (another model shape)."""


class CheckpointSpaceError(OSError):
    """Not enough free space for a checkpoint."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):  # OSError pickles (errno, strerror): one argument here, or Ray cannot rebuild it
        return (type(self), (self.strerror,))


def checkpoint_files(path: str) -> List[str]:
    """Every file of the checkpoint directory ``path`` (relative, sorted), the manifest excepted."""
    out = []
    for dirpath, _, files in os.walk(path):
        for fn in files:
            rel = os.path.relpath(os.path.join(dirpath, fn), path)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def describe(path: str, names: Iterable[str]) -> Dict[str, Tuple[int, int]]:
    """``{name: (size, crc32)}`` of the given files under ``path``."""
    out = {}
    for name in names:
        crc, size = 0, 0
        with open(os.path.join(path, name), "rb") as f:
            while True:
                block = f.read(_CHUNK)
                if not block:
                    break
                crc, size = zlib.crc32(block, crc), size + len(block)
        out[name] = (size, crc)
    return out


def write_manifest(path: str, entries: Dict[str, Tuple[int, int]]) -> None:
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump({"version": 1, "files": {k: list(v) for k, v in sorted(entries.items())}}, f, indent=0)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(path: str) -> Optional[Dict[str, Tuple[int, int]]]:
    """The manifest's entries; None for a checkpoint written before manifests existed. Raises
    :class:`CheckpointCorruptError` when the manifest itself is unreadable."""
    p = os.path.join(path, MANIFEST)
    if not os.path.exists(p):
        return None
    try:
        with open(p) as f:
            return {k: (int(v[0]), int(v[1])) for k, v in json.load(f)["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise CheckpointCorruptError(f"{p}: unreadable manifest ({type(e).__name__}: {e})") from None


def verify(path: str, expected: Dict[str, Tuple[int, int]], names: Sequence[str]) -> Optional[str]:
    """The first problem with ``names`` (a subset of the manifest's files) under ``path``, or None."""
    for name in names:
        size, crc = expected[name]
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"{full} is missing"
        actual = os.path.getsize(full)
        if actual != size:
            return f"{full} has {actual} bytes, the manifest says {size} (truncated or overwritten)"
        if describe(path, [name])[name][1] != crc:
            return f"{full} fails its CRC-32 check (the file is corrupt)"
    return None


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _mb(n: float) -> str:
    if n >= 10 * 2**20:
        return f"{n / 2**20:,.0f} MB"
    return f"{n / 2**20:.1f} MB" if n >= 2**20 else f"{n / 2**10:.0f} KB"


def space_problem(root: str, need: int) -> Optional[str]:
    """A message when the file system of ``root`` has less than ``need`` bytes free (else None)."""
    free = shutil.disk_usage(root).free
    if free >= need:
        return None
    return no_space_message(root, need, free)


def no_space_message(root: str, need: int, free: Optional[int] = None) -> str:
    free = shutil.disk_usage(root).free if free is None else free
    return (f"no space left on {root} for a checkpoint: need ~{_mb(need)}, {_mb(free)} free. Free some space or "
            "point checkpoint.root at a larger disk (checkpoint.keep_last bounds how many are kept); the previous "
            "checkpoint is intact, resume=true continues from it")


def is_out_of_space(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps) is a failed write for want of space. torch's zip writer reports it
    as ``RuntimeError: [enforce fail at inline_container.cc:...] unexpected pos``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc)
        if "No space left" in text or "unexpected pos" in text or "Disk quota exceeded" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


# ---------------------------------------------------------------------------------------------------
# collective (every rank calls these)
# ---------------------------------------------------------------------------------------------------


def on_every_rank(fn: Callable[[], Any], root: str, need: int, tmp: str) -> Any:
    """Run ``fn`` on every rank; if it failed on any, raise on every rank (no rank is left waiting in a later
    collective). A failure for want of space becomes one :class:`CheckpointSpaceError` saying how much is
    needed and free (after the partial save is removed)."""
    error, result = None, None
    try:
        result = fn()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException; re-raised below
        error = e
    report = None
    if error is not None:  # dist-checkpointing may wrap the OSError beyond recognition: also look at the disk
        space = is_out_of_space(error) or shutil.disk_usage(root).free < need
        report = (space, f"{type(error).__name__}: {error}")
    reports: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    failed = [r for r in reports if r is not None]
    if not failed:
        return result
    if any(space for space, _ in failed):
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # give the space back; the previous checkpoint is untouched
        dist.barrier()
        raise CheckpointSpaceError(no_space_message(root, need)) from error
    if error is not None:
        raise error
    raise RuntimeError(f"checkpoint save failed on another rank: {failed[0][1]}")


def checksums(tmp: str) -> Dict[str, Tuple[int, int]]:
    """``{file: (size, crc32)}`` of the save in ``tmp``: every rank reads a share of the files (collective;
    an unreadable file fails every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    names = [checkpoint_files(tmp) if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    try:
        mine: Any = describe(tmp, names[0][rank::world])
    except OSError as e:
        mine = f"{type(e).__name__}: {e}"
    parts: List[Any] = [None] * world
    dist.all_gather_object(parts, mine)
    errors = [p for p in parts if isinstance(p, str)]
    if errors:
        raise RuntimeError(f"checkpoint save: cannot read back what was written in {tmp}: {errors[0]}")
    return {k: v for part in parts for k, v in part.items()}


def _agreed(problem: Optional[str]) -> Optional[str]:
    problems: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p), None)


def verify_collective(path: str) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """``(problem, common state)`` of one checkpoint, the same on every rank (collective): the manifest's
    files checked (each rank a share), then the common state read."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        expected = read_manifest(path)
        problem = None if expected is None else verify(path, expected, sorted(expected)[rank::world])
    except (OSError, CheckpointCorruptError) as e:
        problem = str(e)
    problem = _agreed(problem)
    common = None
    if problem is None:
        try:
            common = dist_checkpointing.load_common_state_dict(path)
            common["trainer"]["step"]  # noqa: B018 - present in every checkpoint this module wrote
        except Exception as e:  # noqa: BLE001 - a torn file surfaces as EOFError, UnpicklingError, KeyError...
            problem = f"{os.path.join(path, 'common.pt')} cannot be read ({type(e).__name__}: {e})"
        problem = _agreed(problem)
    return problem, common
