"""Pre-flight checks before a cuda sweep: what breaks multi-GPU boxes, found in seconds
instead of hours into a sweep.

    preflight.check(rig)        # prints warnings; raises PreflightError (exit 2) on a failure

- ``dev_shm``: NCCL's shared-memory transport lives in /dev/shm, and Docker gives a container
  64 MiB unless run with ``--shm-size`` or ``--ipc=host``: where NCCL runs between more than
  one GPU, under ``SHM_MIN_MIB`` fails (a warning where ``NCCL_SHM_DISABLE=1`` keeps NCCL off
  it). The slots of ``--gpu-slots`` (and a cpu rig's workers) talk gloo: no NCCL, no check.
- ``nvml``: the sampler's view of the GPUs (their bus ids, without a CUDA context): without
  NVML the GPU utilisation and energy columns would be empty; so would they on a machine
  of mixed GPUs under a user's CUDA_DEVICE_ORDER other than ``PCI_BUS_ID`` (which a command
  sets where it is unset: ``nvml.order_cuda_by_bus``), where NVML cannot tell which GPU
  CUDA numbers i.
  It counts physical GPUs (``Rig.num_gpus``: two slots on one GPU need one).
- ``cuda_smoke``: on any cuda rig (one GPU, slots included), one fresh process per physical
  GPU starts CUDA there, runs a small matrix product and a convolution, synchronises and
  checks them against the CPU (``measure.cuda_smoke``), under a timeout: a driver too old
  for this torch's CUDA, a GPU the wheel has no kernels for, a container without its GPUs
  stop the run here, with what to do, instead of making every case an error.
- ``all_reduce`` (more than one device, after a passed smoke test): one process per device,
  joined through the workers' own ``process_groups.init_process_group`` (NCCL on GPUs,
  gloo on a cpu rig), a short all-reduce checked against its expected sum, a barrier, under
  a timeout: a hang (P2P broken by ACS or an IOMMU, a blocked interface) or a crash stops
  the run before any case.
- ``peer_access``: which GPU pairs reach each other directly (CUDA, in those processes):
  a pair without is a warning (NCCL then goes through host memory: slower, not wrong).

This module runs them in order and gives the verdict. The checks that start nothing
(``dev_shm``, ``nvml``) are ``measure.preflight_static``'s; the probes, which start
processes (``cuda_smoke``, ``all_reduce`` and ``peer_access``: children in one process
group, killed whole on timeout; the runner itself never touches CUDA), are
``measure.preflight_probes``'.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from bench_lib.measure.preflight_probes import (
    SMOKE_TIMEOUT_S,
    TIMEOUT_S,
    all_reduce,
    cuda_smoke,
)
from bench_lib.measure.preflight_static import Check, nvml_check, shm_check
from bench_lib.rig import Rig, RigError

SETTLE_S = 5.0
"""Wait after the checks that ran on the GPUs, so that the idle power measured next sees
idle GPUs."""


class PreflightError(RigError):
    """The rig failed its pre-flight: the sweep would fail or hang (exit 2)."""


def run(rig: Rig, timeout_s: float = TIMEOUT_S, environ: Mapping[str, str] | None = None,
        shm: Mapping[str, Any] | None = None, nvml: Any = None,
        command: Sequence[str] | None = None, smoke_timeout_s: float = SMOKE_TIMEOUT_S,
        smoke_command: Sequence[str] | None = None) -> list[Check]:
    """Every check for ``rig`` (``shm``: /dev/shm's record, default measured). The all-reduce
    runs only where CUDA passed its smoke test (it would fail the same way, slower)."""
    from bench_lib.measure.environment import shm_size

    checks = [shm_check(rig, shm_size() if shm is None else shm, environ)]
    if rig.kind == "cuda":
        checks.append(nvml_check(rig, nvml, environ))
        checks.append(cuda_smoke(rig, smoke_timeout_s, smoke_command))
    cuda_broken = any(c.name == "cuda_smoke" and c.status == "fail" for c in checks)
    if rig.num_devices > 1 and not cuda_broken:
        checks += all_reduce(rig, timeout_s, command)
    return checks


def check(rig: Rig, quiet: bool = False, **kwargs: Any) -> list[Check]:
    """``run``'s checks, warnings printed (unless ``quiet``); raises ``PreflightError``
    naming every failure (the command line exits 2 before the run folder exists)."""
    if not quiet:
        print(f"pre-flight of rig {rig.label} ...", file=sys.stderr)
    checks = run(rig, **kwargs)
    for c in checks:
        if c.status == "warn" and not quiet:
            print(f"pre-flight warning: {c.name}: {c.detail}", file=sys.stderr)
    failed = [c for c in checks if c.status == "fail"]
    if failed:
        raise PreflightError(f"pre-flight of rig {rig.label} failed; no case was run: "
                             + "; ".join(f"{c.name}: {c.detail}" for c in failed))
    if rig.kind == "cuda" and any(c.name in ("cuda_smoke", "all_reduce") for c in checks):
        time.sleep(SETTLE_S)  # the GPUs' clocks and power back to idle before idle power
    return checks
