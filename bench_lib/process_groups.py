"""Joining a case's process group: its rendezvous, backend, network interface and GPU."""

from __future__ import annotations

import datetime
import os
import platform

import torch

from bench_lib.rig import Rig


def init_process_group(
    rig: Rig, rank: int, world_size: int, init_file: str, timeout_s: float,
    local_rank: int | None = None, loopback: bool = True,
) -> None:
    """Join a case's process group: through a ``file://`` rendezvous (``init_file``, unique
    per case: the local launcher), or through ``env://`` where ``init_file`` is empty (the
    store torchrun's rendezvous set up, at its MASTER_ADDR and MASTER_PORT).

    NCCL on cuda rigs, gloo on cpu rigs. A group on one node (``loopback``) talks over
    loopback only: on Linux both libraries are told so (``GLOO_SOCKET_IFNAME`` and
    ``NCCL_SOCKET_IFNAME`` = ``lo``, unless already set), so NCCL's bootstrap and socket
    fallback never pick another interface (a docker bridge, a VPN) to reach a rank on the
    same host. NCCL's intra-node transports (P2P, NVLink, shared memory) are unaffected. A
    group that spans nodes leaves the interface to the libraries (or to those variables, set
    by the user). A cuda rank selects its GPU (``local_rank``, default ``rank``: its slot on
    this node) before joining, and passes it as ``device_id`` (NCCL binds its communicator
    eagerly).
    """
    import torch.distributed as dist

    if loopback and platform.system() == "Linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=timeout_s)
    slot = rank if local_rank is None else local_rank
    device_id = None
    if rig.kind == "cuda":
        device = rig.device(slot)
        torch.cuda.set_device(rig.cuda_index(slot))
        if rig.backend == "nccl":
            device_id = device
    dist.init_process_group(
        backend=rig.backend,
        init_method=f"file://{init_file}" if init_file else "env://",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device_id,
    )
