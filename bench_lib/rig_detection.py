"""Finding the rig this machine offers: its GPUs, or cpu workers on its physical cores.

Counting GPUs here never initialises CUDA in this process (the runner's: a context would
hold memory on a GPU the cases measure). A dry run plans a cuda rig of any size without
asking the machine anything.
"""

from __future__ import annotations

import torch

from bench_lib.rig import RIG_KINDS, Rig, RigError
from bench_lib.topology import CpuTopology, allot_cores, read_cpu_topology


def cuda_device_count() -> int:
    """GPUs visible to CUDA, counted without initialising CUDA in this process.

    ``torch.cuda.device_count`` asks NVML first (no ``cuInit``, no context; it honours
    CUDA_VISIBLE_DEVICES) and falls back to the CUDA runtime only where NVML fails;
    ``torch.cuda.is_available`` would call ``cudaGetDeviceCount`` and initialise the driver.
    A GPU that NVML sees but CUDA cannot use fails the pre-flight check, before any case.
    """
    return torch.cuda.device_count() if torch.backends.cuda.is_built() else 0


def detect_rig(
    kind: str | None = None, num_devices: int | None = None, threads: int | None = None,
    topology: CpuTopology | None = None, plan_only: bool = False, gpu_slots: int = 1,
) -> Rig:
    """Detect the rig, with optional overrides from the CLI.

    Default: every visible GPU when CUDA is available; otherwise two CPU workers (one on a
    machine with one physical core) that share the available physical cores evenly, one
    thread per physical core. ``topology`` defaults to this machine's (sysfs).

    ``plan_only`` (a dry run): a cuda rig of ``num_devices`` GPUs is built without asking
    CUDA or NVML anything, whatever this machine has, so that a sweep for an N-GPU box can be
    planned anywhere; nothing may run on such a rig.

    ``gpu_slots`` above 1 (the validation mode, ``Rig.gpu_slots``): ``num_devices`` slots
    (default: every GPU's slots) on ceil(num_devices / gpu_slots) GPUs; cuda only.
    """
    if gpu_slots > 1:
        if kind == "cpu":
            raise RigError(f"--gpu-slots {gpu_slots} needs a cuda rig (it puts several device "
                           f"slots on one GPU); a cpu rig's devices are its workers")
        kind = "cuda"
    if kind == "cuda" and plan_only and num_devices is not None:
        return Rig("cuda", num_devices, gpu_slots=gpu_slots)
    if kind is None:
        kind = "cuda" if cuda_device_count() > 0 else "cpu"
    if kind == "cuda":
        have = cuda_device_count()
        if have == 0:
            raise RigError("--rig cuda asked for, but no CUDA GPU is visible"
                           + (": give --devices N to plan a sweep for N GPUs" if plan_only
                              else ": a run needs GPUs (--dry-run --devices N plans the "
                                   "sweep for N GPUs without them)"))
        n = have * gpu_slots if num_devices is None else num_devices
        rig = Rig("cuda", n, gpu_slots=gpu_slots)
        if rig.num_gpus > have:
            slots = f" at {gpu_slots} slots per GPU" if gpu_slots > 1 else ""
            raise RigError(f"{n} devices asked for{slots}, but this cuda rig has {have} GPU(s)")
        return rig
    if kind != "cpu":
        raise RigError(f"unknown rig kind {kind!r}; valid: {', '.join(RIG_KINDS)}")
    topology = topology or read_cpu_topology()
    have = len(topology.cores)
    n = num_devices if num_devices is not None else min(2, have)
    if n > have:
        raise RigError(f"{n} devices asked for, but this cpu rig has {have} physical core(s)")
    t = threads if threads is not None else max(1, have // max(n, 1))
    workers = allot_cores(topology, n, t)
    handed = [c for w in workers for c in w]
    order = handed + [c for c in topology.cores if c not in handed]
    return Rig("cpu", n, t, tuple(cpu for c in order for cpu in c.cpus),
               tuple(c.cpus for c in order))
