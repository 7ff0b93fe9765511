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
- ``topology``: how the GPUs reach each other (NVML: the PCIe path, P2P read/write, NVLink),
  the IOMMU and PCIe ACS where the OS shows them, the driver, CUDA and NCCL, in one line
  (``topology.gpu_link_line``, env.json ``multi_gpu.summary``): a warning where the IOMMU
  remaps DMA or a bridge redirects peer requests (NCCL's P2P can hang there).
- ``cuda_smoke``: on any cuda rig (one GPU, slots included), one fresh process per physical
  GPU starts CUDA there, runs a small matrix product and a convolution, synchronises and
  checks them against the CPU (``measure.cuda_smoke``), under a timeout: a driver too old
  for this torch's CUDA, a GPU the wheel has no kernels for, a container without its GPUs
  stop the run here, with what to do, instead of making every case an error.
- ``peer_copy`` (two GPUs or more, after a passed smoke test): a known pattern copied from
  each GPU to each other and back, by ``.to()`` and by ``copy_(non_blocking=True)``, every
  copy compared on the host: a peer copy that corrupts without an error
  (NVIDIA/open-gpu-kernel-modules#1257: DataParallel diverging on 2x RTX 6000 Ada) stops the
  run, whatever NCCL does.
- ``all_reduce`` (more than one device, after the checks above passed): one process per device,
  joined through the workers' own ``process_groups.init_process_group`` (NCCL on GPUs,
  gloo on a cpu rig), a short all-reduce checked against its expected sum, a barrier, under
  a timeout: a hang (P2P broken by ACS or an IOMMU, a blocked interface) or a crash stops
  the run before any case. On NCCL, a hang or a wrong sum is retried once with
  ``NCCL_P2P_DISABLE=1`` (consumer GPUs whose P2P hangs NCCL: NVIDIA/nccl-tests#117): where
  that passes, ``nccl_fallback`` says so and ``check`` sets the variable for the whole run
  (every process it starts inherits it), prints it first, and env.json and every figure's
  caption carry it; where it fails too, the run stops with the fixes to try (``FIXES``;
  the same where the copies corrupt).
  Within a minute: an attempt's ranks get 40 s to join their group (``JOIN_TIMEOUT_S``:
  a slow start is no hang, and switches nothing off), then 20 s for the all-reduce
  (``TIMEOUT_S``); one retry, of a hung or wrong all-reduce only (a start that hangs is
  before NCCL connects any peer: exit 2 with the fixes).
- ``peer_access``: which GPU pairs reach each other directly (CUDA, in those processes):
  a pair without is a warning (NCCL then goes through host memory: slower, not wrong).

This module runs them in order and gives the verdict, printed (``check``) and recorded
(``record``: env.json ``preflight``). The checks that start nothing
(``dev_shm``, ``nvml``) are ``measure.preflight_static``'s; the probes, which start
processes (``cuda_smoke``, ``all_reduce`` and ``peer_access``: children in one process
group, killed whole on timeout; the runner itself never touches CUDA), are
``measure.preflight_probes``'.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from bench_lib.measure.preflight_probes import (
    COPY_TIMEOUT_S,
    NCCL_HINT,
    SMOKE_TIMEOUT_S,
    TIMEOUT_S,
    all_reduce,
    cuda_smoke,
    peer_copy,
)
from bench_lib.measure.preflight_static import Check, nvml_check, shm_check
from bench_lib.rig import Rig, RigError

SETTLE_S = 5.0
"""Wait after the checks that ran on the GPUs, so that the idle power measured next sees
idle GPUs."""
P2P_OFF = {"NCCL_P2P_DISABLE": "1"}
"""The all-reduce's one retry: NCCL through host memory instead of peer-to-peer."""
FIXES = {
    "p2p": "NCCL_P2P_DISABLE=1 (consumer GPUs whose peer-to-peer hangs NCCL: "
           "NVIDIA/nccl-tests#117)",
    "acs": "PCIe ACS off in the BIOS, or its redirection cleared on the bridges above the "
           "GPUs (NVIDIA/nccl#2079)",
    "iommu": "the IOMMU off in the BIOS or in passthrough (kernel command line iommu=pt, "
             "NVIDIA/nccl#257)",
    "driver": "a newer NVIDIA driver (silent peer-copy corruption: "
              "NVIDIA/open-gpu-kernel-modules#1257)",
}
"""What to try when GPUs cannot talk to each other, the public issues behind each."""


def fixes(*names: str) -> str:
    """``Try: ...``: the ``FIXES`` named, in that order."""
    return "Try: " + "; ".join(FIXES[n] for n in names)


class PreflightError(RigError):
    """The rig failed its pre-flight: the sweep would fail or hang (exit 2)."""


def topology_check(rig: Rig, nvml: Any = None, environ: Mapping[str, str] | None = None,
                   host: Mapping[str, Any] | None = None) -> Check:
    """``topology``: the rig's GPUs' links, IOMMU and ACS in one line, with the driver, CUDA
    and NCCL (``host``: the IOMMU and ACS records to use instead of this machine's)."""
    try:
        return _topology_check(rig, nvml, environ, host)
    except Exception as e:  # what describes the box must never stop it
        return Check("topology", "warn", f"could not be read ({type(e).__name__}: {e})")


def _topology_check(rig: Rig, nvml: Any, environ: Mapping[str, str] | None,
                    host: Mapping[str, Any] | None) -> Check:
    from bench_lib.measure.environment import gpu_topology
    from bench_lib.topology import acs_state, gpu_link_line, iommu_state

    topo = gpu_topology(rig.num_devices, nvml, environ)
    iommu = (host or {}).get("iommu") or iommu_state()
    acs = (host or {}).get("acs") or acs_state([g["bus_id"] for g in topo.get("gpus", [])])
    line = gpu_link_line(topo, iommu, acs) or (
        f"one GPU{'' if rig.gpu_slots == 1 else f' ({rig.gpu_slots} slots)'}"
        if "gpus" in topo else f"GPU links unknown: {topo.get('unsupported')}")
    line += f"; {_versions(nvml)}"
    risky = [what for what, on in (("the IOMMU remaps DMA", iommu.get("state") == "on"),
                                   ("a bridge redirects peer requests (ACS)",
                                    acs.get("state") == "on")) if on]
    if risky and rig.num_gpus > 1:
        return Check("topology", "warn", f"{line}: {' and '.join(risky)}, where NCCL's "
                     "peer-to-peer can hang or go through the CPU (NVIDIA/nccl#257, #2079)")
    return Check("topology", "ok", line)


def _versions(nvml: Any = None) -> str:
    """``driver 550.54.15, CUDA 12.4 (torch built for 12.4), NCCL 2.21.5``: what the GPUs'
    software is, read without a CUDA context (``?``: unknown)."""
    import torch

    from bench_lib.nvml import nvml_session, nvml_text

    driver, cuda = "?", "?"
    try:
        with nvml_session(nvml) as nv:
            driver = nvml_text(nv.nvmlSystemGetDriverVersion())
            version = int(nv.nvmlSystemGetCudaDriverVersion())
            cuda = f"{version // 1000}.{version % 1000 // 10}"
    except Exception:  # no NVML, or an NVML without one of them: unknown
        pass
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # a torch built without NCCL
        nccl = "none"
    return (f"driver {driver}, CUDA {cuda} (torch built for {torch.version.cuda}), "
            f"NCCL {nccl}")


def all_reduce_or_fallback(rig: Rig, timeout_s: float = TIMEOUT_S,
                           command: Sequence[str] | None = None,
                           environ: Mapping[str, str] | None = None) -> list[Check]:
    """``all_reduce``, retried once with ``NCCL_P2P_DISABLE=1`` where NCCL hung or summed
    wrong with peer-to-peer on: where the retry passes, an ``nccl_fallback`` check says the
    run goes on with it; where it fails too, the failure names both and the ``FIXES``."""
    env = os.environ if environ is None else environ
    checks = all_reduce(rig, timeout_s, command)
    first = checks[0]
    # A start that hangs is before any peer is connected (NCCL >= 2.22 connects them at the
    # first collective, NCCL_RUNTIME_CONNECT): P2P's setting is not what hangs there.
    if first.fault == "start" and rig.backend == "nccl":
        return [dataclasses.replace(first, detail=f"{first.detail.replace(NCCL_HINT, '')}. "
                                    f"{fixes('driver', 'p2p', 'iommu')}")]
    if (first.status != "fail" or rig.backend != "nccl"
            or first.fault not in ("hang", "wrong_sum") or env.get("NCCL_P2P_DISABLE") == "1"):
        return checks
    retry = all_reduce(rig, timeout_s, command, P2P_OFF)
    what = "hung" if first.fault == "hang" else "summed wrong"
    if retry[0].status == "ok":
        return [Check("all_reduce", "warn", f"{first.detail}; then {retry[0].detail}"),
                Check("nccl_fallback", "warn",
                      f"NCCL_P2P_DISABLE=1: the all-reduce {what} with peer-to-peer on"),
                *retry[1:]]
    return [Check("all_reduce", "fail", f"{first.detail.replace(NCCL_HINT, '')}; and again "
                  f"{retry[0].detail}. {fixes('acs', 'iommu', 'driver')}", first.fault)]


def run_checks(rig: Rig, timeout_s: float = TIMEOUT_S, environ: Mapping[str, str] | None = None,
        shm: Mapping[str, Any] | None = None, nvml: Any = None,
        command: Sequence[str] | None = None, smoke_timeout_s: float = SMOKE_TIMEOUT_S,
        smoke_command: Sequence[str] | None = None, copy_command: Sequence[str] | None = None,
        host: Mapping[str, Any] | None = None) -> list[Check]:
    """Every check for ``rig`` (``shm``: /dev/shm's record, default measured; ``host``: the
    IOMMU and ACS records, default read). The copies run only where CUDA passed its smoke
    test, the all-reduce only where the copies passed too (it would fail the same way,
    slower, or measure on GPUs that corrupt)."""
    from bench_lib.measure.environment import shm_size

    checks = [shm_check(rig, shm_size() if shm is None else shm, environ)]
    if rig.kind == "cuda":
        checks.append(nvml_check(rig, nvml, environ))
        checks.append(topology_check(rig, nvml, environ, host))
        checks.append(cuda_smoke(rig, smoke_timeout_s, smoke_command))
    broken = any(c.name == "cuda_smoke" and c.status == "fail" for c in checks)
    if rig.kind == "cuda" and rig.num_gpus > 1 and not broken:
        checks.append(peer_copy(rig, COPY_TIMEOUT_S, copy_command))
        if checks[-1].status == "fail":
            checks[-1] = Check("peer_copy", "fail", f"{checks[-1].detail}. "
                               f"{fixes('driver', 'iommu', 'acs')}", checks[-1].fault)
            broken = True
    if rig.num_devices > 1 and not broken:
        checks += all_reduce_or_fallback(rig, timeout_s, command, environ)
    return checks


def fallback(checks: Sequence[Check]) -> str | None:
    """The variable the run goes on with, and why (``nccl_fallback``'s detail), or None."""
    return next((c.detail for c in checks if c.name == "nccl_fallback"), None)


def record(checks: Sequence[Check], seconds: float | None = None) -> dict[str, Any]:
    """env.json ``preflight``: each check's verdict, the NCCL fallback (or None) and how
    long the pre-flight took."""
    return {"checks": [{"name": c.name, "status": c.status, "detail": c.detail}
                       for c in checks],
            "nccl_fallback": fallback(checks), "seconds": seconds}


def check(rig: Rig, quiet: bool = False, **kwargs: Any) -> list[Check]:
    """``run_checks``' checks, the topology and warnings printed (unless ``quiet``); raises
    ``PreflightError`` naming every failure (the command line exits 2 before the run folder
    exists). Where the all-reduce passed only with NCCL_P2P_DISABLE=1, sets it in
    ``environ`` (default this process's environment, which every process of the run
    inherits) and says so, also when ``quiet``."""
    start = time.monotonic()
    if not quiet:
        print(f"pre-flight of rig {rig.label} ...", file=sys.stderr)
    checks = run_checks(rig, **kwargs)
    for c in checks:
        if not quiet and c.name != "nccl_fallback" and (c.status == "warn"
                                                         or c.name == "topology"):
            print(f"pre-flight {'warning: ' if c.status == 'warn' else ''}{c.name}: "
                  f"{c.detail}", file=sys.stderr)
    failed = [c for c in checks if c.status == "fail"]
    if failed:
        raise PreflightError(f"pre-flight of rig {rig.label} failed; no case was run: "
                             + "; ".join(f"{c.name}: {c.detail}" for c in failed))
    environ = kwargs.get("environ")
    target: MutableMapping[str, str] = (
        environ if isinstance(environ, MutableMapping) else os.environ)
    if fallback(checks) is not None:
        target.update(P2P_OFF)
        print(f"pre-flight: this run goes on with {fallback(checks)}, and records it "
              "(env.json preflight, every figure's caption)", file=sys.stderr)
    if not quiet:
        print(f"pre-flight passed in {time.monotonic() - start:.1f} s: "
              f"{', '.join(f'{c.name} {c.status}' for c in checks)}", file=sys.stderr)
    if rig.kind == "cuda" and any(c.name in ("cuda_smoke", "all_reduce") for c in checks):
        time.sleep(SETTLE_S)  # the GPUs' clocks and power back to idle before idle power
    return checks
