"""Joining a case's process group (its rendezvous, backend, network interface and GPU), and
leaving it without hanging on a peer stuck in a collective."""

from __future__ import annotations

import datetime
import os
import platform
import sys
import threading
import traceback

import torch
import torch.distributed as dist

from bench_lib.rig import Rig

SHUTDOWN_S = 10.0
"""How long a rank waits for ``destroy_process_group`` (which can block where a peer is stuck
in a collective) before it exits without it."""


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


def destroy_process_group(code: int, timeout_s: float = SHUTDOWN_S) -> None:
    """Destroy this rank's process group if one is up, on every path (failures included: a
    rank that exits with an NCCL group up can block in its teardown), never raising.

    ``destroy_process_group`` can itself block where a peer is stuck in a collective: after
    ``timeout_s`` the process exits with ``code`` without it (its result is written).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return

    def give_up() -> None:
        print(f"destroy_process_group still blocked after {timeout_s:g} s; exiting without it",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(code)

    timer = threading.Timer(timeout_s, give_up)
    timer.daemon = True
    timer.start()
    try:
        dist.destroy_process_group()
    except Exception:  # a group a peer's failure broke: nothing more to tear down here
        traceback.print_exc()
    finally:
        timer.cancel()
