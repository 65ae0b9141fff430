"""Process groups: torch.distributed initialisation and Megatron's ``parallel_state``.

Megatron's global ``parallel_state`` is read here, once, at the edge; everything downstream receives
the groups it needs explicitly through :class:`ParallelGroups`.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from megatron_rl import compat
from megatron_rl.config.sections import ParallelLayout


def device() -> torch.device:
    """The device this rank computes on: its CUDA device when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    init_method: Optional[str] = None,
    backend: Optional[str] = None,
    timeout_s: float = 600.0,
    store: Optional[dist.Store] = None,
) -> None:
    """Initialise the default process group (no-op if already initialised).

    Rank, world size and rendezvous default to the usual ``RANK`` / ``WORLD_SIZE`` /
    ``MASTER_ADDR`` / ``MASTER_PORT`` environment (torchrun, Ray workers, SLURM via our scripts);
    ``store`` (e.g. from :func:`rendezvous_store`) replaces ``init_method``.
    """
    if dist.is_initialized():
        return
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if store is None and init_method is None and "MASTER_ADDR" not in os.environ:
        # Single process without a launcher: a private loopback rendezvous.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def rendezvous_store(host: str, port: int, world_size: int, *, is_master: bool,
                     timeout_s: float = 600.0) -> dist.TCPStore:
    """The rendezvous store. The master passes ``port=0``: the OS picks a port and the store holds it
    from then on (``store.port``), so nothing can take it between choosing and binding — unlike a
    "free port" probed first and bound later, which races with every other process starting up.

    The master listens on ``host`` only (``TCPStore`` itself would listen on every interface): a local run
    passes 127.0.0.1 and nothing of it is reachable from the network."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)

    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does: a fixed port rebinds at once
        sock.bind(address)
        sock.listen(max(128, world_size))
    except OSError:
        sock.close()
        raise
    # the store owns the listening socket from here on (it closes it)
    return dist.TCPStore(host, sock.getsockname()[1], world_size, is_master=True, wait_for_workers=False,
                         timeout=timeout, master_listen_fd=sock.detach())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]




@dataclass(frozen=True)
class ParallelGroups:
    """The process groups one rank needs, read once from Megatron's ``parallel_state``."""

    layout: ParallelLayout
    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    cp: dist.ProcessGroup
    ep: dist.ProcessGroup
    dp_cp: dist.ProcessGroup
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int
    ep_rank: int

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0


def init_megatron_parallel(layout: ParallelLayout, seed: int = 1234) -> ParallelGroups:
    """Initialise Megatron's ``parallel_state`` for ``layout`` and return the groups explicitly.

    Requires an initialised default process group. On a machine without CUDA the CPU compatibility
    layer (:mod:`megatron_rl.compat`) is applied first.
    """
    if not dist.is_initialized():
        raise RuntimeError("call megatron_rl.parallel.init_process_group() first")

    compat.apply()

    layout.check(dist.get_world_size())
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        create_gloo_process_groups=not torch.cuda.is_available(),
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ParallelGroups(
        layout=layout,
        tp=ps.get_tensor_model_parallel_group(),
        pp=ps.get_pipeline_model_parallel_group(),
        dp=ps.get_data_parallel_group(),
        cp=ps.get_context_parallel_group(),
        ep=ps.get_expert_model_parallel_group(),
        dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
    )


def destroy() -> None:
    """Tear down Megatron's parallel state and the default process group."""
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
    except ImportError:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()
