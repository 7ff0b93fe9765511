"""What a run folder records about the machine and software it ran on (env.json)."""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torchvision

from bench_lib import turns
from bench_lib.fault_hooks import TEST_HOOK_VARIABLES
from bench_lib.math_modes import DEFAULT_MATH_MODE, set_math_mode
from bench_lib.measure import speed_probe
from bench_lib.nvml import cuda_visible_gpus, nvml_session, nvml_text
from bench_lib.pinning import heap_policy
from bench_lib.results.schema import SCHEMA_VERSION
from bench_lib.rig import Rig
from bench_lib.rig_detection import cuda_device_count
from bench_lib.topology import (
    CpuTopology,
    acs_state,
    available_cores,
    gpu_link_line,
    iommu_state,
    read_cpu_topology,
)


def git_info(repo: Path | None = None) -> dict[str, Any]:
    """The git sha and dirty flag of the code that ran (None for both outside a checkout)."""
    cwd = repo or Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}
    return {"sha": sha, "dirty": dirty}


def cpu_model() -> str:
    """The CPU model name (from /proc/cpuinfo on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def nvidia_driver() -> str | None:
    """The NVIDIA driver version through NVML, or None without one."""
    try:
        import pynvml  # provided by nvidia-ml-py

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else version
    except Exception:  # no driver, no library, no GPU: all mean "none"
        return None


def software_versions() -> dict[str, Any]:
    """Versions of everything that changes what is measured.

    Read in the runner, so without a CUDA context: the GPU count through NVML
    (``rig_detection.cuda_device_count``); NCCL's and cuDNN's versions are library calls.
    """
    cuda = cuda_device_count() > 0
    nccl = None
    if cuda and hasattr(torch.cuda, "nccl"):
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # NCCL missing from this build
            nccl = None
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": nccl,
        "driver": nvidia_driver() if cuda else None,
        "cuda_available": cuda,
    }


def hardware_fingerprint(rig: Rig, topology: CpuTopology | None = None) -> dict[str, Any]:
    """The hardware that must match for two runs' absolute numbers to be comparable.

    Hardware only: the rig, its device names, the CPU model and cores, and on a cpu rig the
    topology of the rig's cores (packages, physical cores, logical CPUs, threads per core;
    ``topology`` defaults to sysfs's). Software (torch, the driver, ...) is not part of it:
    it is in ``versions``, and the gate reports its differences beside the verdict.
    """
    fingerprint: dict[str, Any] = {
        "rig": rig.label,
        "device_names": rig.device_names(),
        "cpu_model": cpu_model(),
        "cpu_cores": len(available_cores()),
    }
    if rig.kind == "cpu":
        fingerprint["cpu_topology"] = (topology or read_cpu_topology(rig.cores)).counts()
    return fingerprint


def cpu_topology(rig: Rig, topology: CpuTopology | None = None) -> dict[str, Any] | None:
    """env.json ``cpu_topology``: the rig's cores as physical cores and packages, and which
    whole physical cores each cpu worker holds (None on a cuda rig)."""
    if rig.kind != "cpu":
        return None
    topo = topology or read_cpu_topology(rig.cores)
    by_cpus = {c.cpus: c for c in topo.cores}
    workers = []
    for i in range(rig.num_devices):
        t = rig.threads_per_worker
        mine = [by_cpus.get(g) for g in rig.core_groups[i * t:(i + 1) * t]]
        workers.append({
            "device": i,
            "cpus": rig.cores_of(i),
            "physical_cores": [list(g) for g in rig.core_groups[i * t:(i + 1) * t]],
            "packages": sorted({c.package for c in mine if c is not None}),
        })
    return {
        **topo.counts(),
        "physical_cores_list": [{"package": c.package, "core_id": c.core_id,
                                 "cpus": list(c.cpus)} for c in topo.cores],
        "workers": workers,
        "rule": "each worker holds threads_per_worker whole physical cores (their "
                "hyper-thread siblings too, one thread per physical core); no two workers "
                "share a physical core",
    }


SHM_PATH = Path("/dev/shm")
TOPOLOGY_LEVELS = {0: "BOARD (one multi-GPU board)", 10: "PIX (one PCIe switch)",
                   20: "PXB (several PCIe switches)", 30: "PHB (a PCIe host bridge)",
                   40: "NODE (host bridges within one NUMA node)",
                   50: "SYS (across NUMA nodes: SMP interconnect)"}
"""NVML's common-ancestor levels (nvmlGpuTopologyLevel_t), named as ``nvidia-smi topo -m``."""
P2P_CAPS = {"read": 0, "write": 1, "nvlink": 2, "atomics": 3}
"""NVML's P2P capability indices (nvmlGpuP2PCapsIndex_t)."""
P2P_STATUS = {0: "ok", 1: "chipset not supported", 2: "gpu not supported",
              3: "ioh topology not supported", 4: "disabled by regkey", 5: "not supported",
              6: "unknown"}
NVLINK_MAX_LINKS = 18


def shm_size(path: Path = SHM_PATH) -> dict[str, Any]:
    """The size of ``path`` (/dev/shm: NCCL's shared-memory transport lives there; Docker
    gives a container 64 MiB unless run with ``--shm-size`` or ``--ipc=host``)."""
    try:
        st = os.statvfs(path)
    except OSError as e:
        return {"path": str(path), "unsupported": f"{type(e).__name__}: {e}"}
    return {"path": str(path), "total_mib": st.f_frsize * st.f_blocks / 2**20,
            "free_mib": st.f_frsize * st.f_bavail / 2**20}


def _try(fn: Any, *args: Any) -> Any:
    """An NVML reading, or None where this driver, GPU or pynvml lacks it."""
    try:
        return fn(*args)
    except Exception:  # NVMLError_NotSupported, an older pynvml without the function, ...
        return None


def _nvlinks(nv: Any, handle: Any) -> list[str]:
    """The bus ids at the far end of each active NVLink of a GPU (a peer GPU or a switch)."""
    remote = []
    for link in range(NVLINK_MAX_LINKS):
        state = _try(nv.nvmlDeviceGetNvLinkState, handle, link)
        if state is None:  # past the GPU's last link, or no NVLink at all
            break
        if state:
            pci = _try(nv.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
            remote.append("" if pci is None else nvml_text(pci.busId).upper())
    return remote


def gpu_topology(count: int, nvml: Any = None,
                 environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The rig's GPUs as NVML sees them, without a CUDA context: per GPU its CUDA and NVML
    index, name, PCI bus id, UUID and active NVLinks; per pair the link between them (NVLink,
    or the PCIe path: PIX/PXB/PHB/NODE/SYS as ``nvidia-smi topo -m`` writes it), direct
    NVLinks and NVML's P2P status (read, write, nvlink, atomics). Where NVML cannot be read,
    ``unsupported`` says why.
    """
    try:
        gpus = cuda_visible_gpus(nvml, environ)[:count]
        with nvml_session(nvml) as nv:
            handles = [nv.nvmlDeviceGetHandleByPciBusId(g.bus_id) for g in gpus]
            links = [_nvlinks(nv, h) for h in handles]
            devices = [{"cuda_index": g.cuda_index, "nvml_index": g.nvml_index, "name": g.name,
                        "bus_id": g.bus_id, "uuid": g.uuid, "nvlinks_active": len(link)}
                       for g, link in zip(gpus, links)]
            pairs = {f"{i}-{j}": _pair(nv, handles[i], handles[j],
                                       links[i].count(gpus[j].bus_id.upper()))
                     for i in range(len(gpus)) for j in range(i + 1, len(gpus))}
    except Exception as e:  # no NVML library or driver, a GPU it does not see
        return {"unsupported": f"NVML unavailable ({type(e).__name__}: {e})"}
    return {"gpus": devices, "pairs": pairs, "source": "nvml"}


def _pair(nv: Any, a: Any, b: Any, direct: int) -> dict[str, Any]:
    """How two GPUs reach each other; ``direct``: NVLinks from ``a`` that end on ``b``."""
    p2p: dict[str, str | None] = {}
    for cap, index in P2P_CAPS.items():
        status = _try(nv.nvmlDeviceGetP2PStatus, a, b, index)
        p2p[cap] = None if status is None else P2P_STATUS.get(status, str(status))
    level = _try(nv.nvmlDeviceGetTopologyCommonAncestor, a, b)
    pcie = None if level is None else TOPOLOGY_LEVELS.get(level, str(level))
    if direct:
        link: str | None = f"NVLink x{direct}"
    elif p2p["nvlink"] == "ok":  # through NVSwitches: no link ends on the peer itself
        link = "NVLink (switched)"
    else:
        link = None if pcie is None else f"PCIe {pcie.split()[0]}"
    return {"link": link, "pcie_common_ancestor": pcie, "nvlinks_direct": direct, "p2p": p2p}


def nvidia_smi_topology(timeout_s: float = 20.0) -> str | None:
    """``nvidia-smi topo -m`` as printed (None without nvidia-smi or where it fails)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True,
                             timeout=timeout_s, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def multi_gpu_environment(rig: Rig, nvml: Any = None, environ: Mapping[str, str] | None = None,
                          shm: Path = SHM_PATH,
                          nvidia_smi: Callable[[], str | None] = nvidia_smi_topology,
                          iommu: Mapping[str, Any] | None = None,
                          acs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """env.json ``multi_gpu``: what makes multi-GPU boxes misbehave, read without a CUDA
    context in the runner: /dev/shm's size, the variables that choose and order the GPUs
    (CUDA_DEVICE_ORDER unset is CUDA's FASTEST_FIRST) and tune NCCL (every NCCL_*), and on a
    cuda rig the GPUs' bus ids, links and P2P status through NVML (``gpu_topology``), the
    IOMMU and PCIe ACS where the OS shows them (``topology.iommu_state``, ``acs_state``),
    the line that sums them up (``summary``: ``topology.gpu_link_line``, None under two
    GPUs), ``nvidia-smi topo -m`` where present, and the CUDA driver's version as NVML
    reports it (NCCL's version and the driver's are in ``versions``). ``iommu`` and ``acs``
    replace what this machine shows (tests).
    """
    env = os.environ if environ is None else environ
    record: dict[str, Any] = {
        "dev_shm": shm_size(shm),
        "cuda_device_order": env.get("CUDA_DEVICE_ORDER"),
        "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
        "nccl_env": {k: v for k, v in sorted(env.items()) if k.startswith("NCCL_")},
    }
    if rig.kind != "cuda":
        return record
    record["topology"] = topology = gpu_topology(rig.num_devices, nvml, env)
    record["iommu"] = dict(iommu) if iommu is not None else iommu_state()
    record["acs"] = (dict(acs) if acs is not None
                     else acs_state([g["bus_id"] for g in topology.get("gpus", [])]))
    record["summary"] = gpu_link_line(topology, record["iommu"], record["acs"])
    cuda: int | None = None
    nvml_version: str | None = None
    try:
        with nvml_session(nvml) as nv:
            cuda = _try(nv.nvmlSystemGetCudaDriverVersion)
            version = _try(nv.nvmlSystemGetNVMLVersion)
            nvml_version = None if version is None else nvml_text(version)
    except Exception:  # no NVML: the topology says why
        pass
    record["cuda_driver_version"] = (None if cuda is None
                                     else f"{cuda // 1000}.{cuda % 1000 // 10}")
    record["nvml_version"] = nvml_version
    record["nvidia_smi_topo_m"] = nvidia_smi()
    return record


def collect(rig: Rig, profile: dict[str, Any], argv: list[str],
            attainable_peak: dict[str, Any] | None = None,
            idle_power: dict[str, Any] | None = None,
            math_mode: str = DEFAULT_MATH_MODE,
            preflight: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Everything env.json holds; ``attainable_peak`` is the measured FLOP peak (flop_peak.py),
    ``idle_power`` the rig's power with nothing of ours running (energy.py), ``math_mode``
    the run's (``Measurement.math_mode``), whose flags are recorded; ``preflight`` the
    pre-flight's verdict and NCCL fallback (``measure.preflight.record``; None: none ran)."""
    env = {
        "schema_version": SCHEMA_VERSION,
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "versions": software_versions(),
        "rig": rig.as_dict(),
        "device_names": rig.device_names(),
        "cpu_model": cpu_model(),
        "cpu_cores": len(available_cores()),
        "git": git_info(),
        "fingerprint": hardware_fingerprint(rig),
        "cpu_topology": cpu_topology(rig),
        # What a cpu worker does with the memory it frees (pinning.keep_heap).
        "cpu_heap": heap_policy() if rig.kind == "cpu" else None,
        # The machine's speed control each cpu rank times before each step (steps.csv probe_s).
        "speed_probe": speed_probe.PROBE if rig.kind == "cpu" else None,
        # The gate's side whose steps this run's ranks took in turns with the other's
        # (bench_lib.turns: base or head); None: alone.
        "turns": turns.requested_side(),
        # /dev/shm, GPU ordering and NCCL variables; on GPUs links, P2P and bus ids (NVML).
        "multi_gpu": multi_gpu_environment(rig),
        # What every worker and the peak probe set (math_modes.set_math_mode), read back here.
        "math_mode": set_math_mode(math_mode),
        "profile": profile,
        "command_line": argv,
        "test_hooks": {k: v for k, v in os.environ.items() if k in TEST_HOOK_VARIABLES and v},
    }
    env["preflight"] = None if preflight is None else dict(preflight)
    if attainable_peak is not None:
        env["attainable_peak"] = attainable_peak
    if idle_power is not None:
        env["idle_power"] = idle_power
    return env
