"""The pre-flight's checks that start nothing (``measure.preflight`` runs them): whether
/dev/shm is big enough for NCCL between the rig's GPUs (``shm_check``) and whether the
sampler can read the GPUs through NVML (``nvml_check``); and ``Check``, the verdict every
pre-flight check returns."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bench_lib.rig import Rig

SHM_MIN_MIB = 512.0
"""/dev/shm smaller than this fails the pre-flight of a multi-GPU rig."""


@dataclass(frozen=True)
class Check:
    """One pre-flight check's verdict."""

    name: str
    status: str
    """``ok``, ``warn`` (the run goes on) or ``fail`` (the run stops)."""
    detail: str
    fault: str = ""
    """What went wrong, in a word, where a retry depends on it: ``hang``, ``wrong_sum``,
    ``corrupt``, ``error``; empty otherwise."""


def shm_check(rig: Rig, shm: Mapping[str, Any],
              environ: Mapping[str, str] | None = None) -> Check:
    """Whether /dev/shm (``shm``: ``environment.shm_size``'s record) is big enough for NCCL
    between the rig's GPUs: physical GPUs, where NCCL runs (``Rig.backend``)."""
    env = os.environ if environ is None else environ
    path = shm.get("path", "/dev/shm")
    if rig.backend != "nccl":
        between = "GPU slots" if rig.kind == "cuda" else "workers"
        return Check("dev_shm", "ok", f"the {between} talk {rig.backend}: NCCL's shared-memory "
                     "transport is not used")
    world_size = rig.num_gpus
    if world_size < 2:
        return Check("dev_shm", "ok", "one GPU: NCCL does not use shared memory")
    if "total_mib" not in shm:
        return Check("dev_shm", "warn", f"{path} cannot be read ({shm.get('unsupported')}): "
                     "NCCL's shared-memory transport may fail")
    total = float(shm["total_mib"])
    if total >= SHM_MIN_MIB:
        return Check("dev_shm", "ok", f"{path} is {total:.0f} MiB")
    small = (f"{path} is {total:.0f} MiB, under {SHM_MIN_MIB:.0f} MiB (Docker's default is "
             "64 MiB)")
    if env.get("NCCL_SHM_DISABLE") == "1":
        return Check("dev_shm", "warn", f"{small}; NCCL_SHM_DISABLE=1 keeps NCCL off it")
    return Check("dev_shm", "fail",
                 f"{small}: NCCL's shared-memory transport between the {world_size} GPUs can "
                 "fail or hang there. Give the container more (docker run --shm-size=1g, or "
                 "--ipc=host), or set NCCL_SHM_DISABLE=1 to keep NCCL off /dev/shm (slower "
                 "where GPUs have no peer access)")


def nvml_check(rig: Rig, nvml: Any = None, environ: Mapping[str, str] | None = None) -> Check:
    """Whether the runner's sampler can read the rig's GPUs through NVML (a warning if not)."""
    from bench_lib.nvml import CudaOrderUnknown, cuda_visible_gpus

    env = os.environ if environ is None else environ
    try:
        gpus = cuda_visible_gpus(nvml, env)
    except CudaOrderUnknown as e:
        return Check("nvml", "warn", f"{e}: GPU utilisation, power and energy will be empty")
    except Exception as e:
        return Check("nvml", "warn", f"NVML unavailable ({type(e).__name__}: {e}): GPU "
                     "utilisation, power and energy will be empty")
    if len(gpus) < rig.num_gpus:  # GPUs, not slots: two slots on one GPU need one
        return Check("nvml", "warn", f"NVML sees {len(gpus)} of the rig's {rig.num_gpus} "
                     "GPUs: the others' utilisation and energy will be empty")
    buses = ", ".join(f"{g.cuda_index}: {g.bus_id}" for g in gpus[:rig.num_gpus])
    return Check("nvml", "ok", f"bus ids {buses}")
