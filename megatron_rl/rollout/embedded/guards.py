"""The embedded server's checks on what a client asks it to store, write or wait for (issue 28): bounded
weight-version strings, finite weight buckets, profiler output confined to the server's folder, and a weight
group's master that must listen before the server waits on it. Each raises ``ValueError`` with the field and the
fix; the endpoints turn it into SGLang's error answer."""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Iterable, Sequence, Tuple

import torch

MAX_VERSION_CHARS = 256  # a version is echoed in every /generate answer and in /model_info


def bounded_version(value: Any, field: str) -> Any:
    """``value`` (a weight version) when it is at most :data:`MAX_VERSION_CHARS` characters."""
    if isinstance(value, str) and len(value) > MAX_VERSION_CHARS:
        raise ValueError(f"{field} is {len(value)} characters long; at most {MAX_VERSION_CHARS} are accepted (it is "
                         "echoed in every /generate answer): send a short version such as the training step")
    return value


def require_finite(buckets: Iterable[Sequence[Tuple[str, torch.Tensor]]]) -> None:
    """Refuse a bucket holding NaN or inf before any of it is loaded: one host sync per bucket (a flag per
    floating tensor, reduced on the tensors' device)."""
    for bucket in buckets:
        floats = [(name, t) for name, t in bucket if t.is_floating_point() or t.is_complex()]
        if not floats:
            continue
        flags = torch.stack([torch.isfinite(t).all().to(floats[0][1].device) for _, t in floats])
        if bool(flags.all()):
            continue
        name, t = floats[int((~flags).nonzero()[0])]
        bad = ~torch.isfinite(t)
        raise ValueError(f"tensor {name!r} holds {int(bad.sum())} non-finite values of {t.numel()} (NaN or inf): the "
                         "trainer's weights diverged or were corrupted on the way; nothing of this bucket was loaded "
                         "and the engine keeps serving its previous weights")


def profile_output_dir(value: Any, root: str) -> str:
    """Where ``/start_profile`` may write: ``output_dir`` (relative ones are taken inside ``root``) resolved with
    its symbolic links must lie inside ``root``, the server's profile folder, and must not be a file."""
    if value is None or value == "":
        value = root
    if not isinstance(value, str):
        raise ValueError(f"output_dir={value!r}: expected a folder path (a string)")
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, value))
    if os.path.commonpath([real, real_root]) != real_root:
        raise ValueError(f"output_dir={value!r} resolves to {real}, outside this server's profile folder {real_root}: "
                         "name a folder inside it (or start the server with --profile-dir covering that path)")
    if os.path.exists(real) and not os.path.isdir(real):
        raise ValueError(f"output_dir={value!r} is an existing file, not a folder: name a folder")
    return real


MAX_GROUP_SIZE = 1 << 16


def check_group_ranks(rank_offset: int, world_size: int) -> None:
    """This server joins as rank ``rank_offset`` of ``world_size`` (rank 0 is the trainer's)."""
    if not 2 <= world_size <= MAX_GROUP_SIZE:
        raise ValueError(f"world_size={world_size}: expected 2..{MAX_GROUP_SIZE} (the trainer's rank 0 and the engines)")
    if not 1 <= rank_offset < world_size:
        raise ValueError(f"rank_offset={rank_offset}: expected 1..world_size-1 = {world_size - 1} (rank 0 is the "
                         "trainer's)")


def wait_for_master(address: str, port: int, timeout_s: float) -> None:
    """Raise unless a TCP connection to the weight group's master ``address:port`` succeeds within ``timeout_s``
    (the trainer's rank 0 hosts the group's store before it asks engines to join, so it is already listening);
    without this the join would retry for the whole rendezvous timeout (300 s) with no word."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"master_port={port!r}: expected a TCP port in [1, 65535]")
    deadline = time.monotonic() + timeout_s
    last: Exception = TimeoutError("no attempt")
    while True:
        try:
            with socket.create_connection((address, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            raise ValueError(f"nothing listens on master_address:master_port = {address}:{port} ({last}; tried for "
                             f"{timeout_s:g} s): the trainer's rank 0 must host the weight group's store there before "
                             "calling /init_weights_update_group; check the address and port")
        time.sleep(0.2)
