"""The machine's topology: the physical cores behind a cpu rig, and how they are handed out
to its workers; and what lies between a cuda rig's GPUs that NVML does not say (the IOMMU,
PCIe ACS on the bridges above them), with the one line that names a GPU rig's links
(``gpu_link_line``, env.json ``multi_gpu.summary``, the pre-flight, the report's caption).

A cpu worker of T threads holds T whole *physical* cores (with their hyper-thread siblings,
read from sysfs): one thread per physical core, and no two workers ever share one, so a
worker's threads never compete with another worker's for a core's execution units.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from bench_lib.rig import RigError


def available_cores() -> list[int]:
    """The CPU cores this process may run on (respects taskset/cgroups affinity)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


SYSFS_CPU = Path("/sys/devices/system/cpu")


class PhysicalCore(NamedTuple):
    """One physical core: its package (socket), core id and the logical CPUs we may use."""

    package: int
    core_id: int
    cpus: tuple[int, ...]
    """Its hyper-thread siblings that this process may run on (sorted)."""


def _cpu_list(text: str) -> list[int]:
    """``0-3,8,10-11`` (sysfs cpu list) -> [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for part in text.strip().split(","):
        if "-" in part:
            lo, hi = part.split("-")
            out.extend(range(int(lo), int(hi) + 1))
        elif part:
            out.append(int(part))
    return out


@dataclass(frozen=True)
class CpuTopology:
    """The physical cores behind a set of logical CPUs (from sysfs, or assumed)."""

    cores: tuple[PhysicalCore, ...]
    """Physical cores, ordered by package then core id."""
    source: str = "sysfs"
    """``sysfs``, or ``assumed: <why>`` when every logical CPU is taken as its own core."""

    def package_of(self, cpu: int) -> int | None:
        """The package (socket) holding logical CPU ``cpu``, or None if unknown."""
        return next((c.package for c in self.cores if cpu in c.cpus), None)

    def counts(self) -> dict[str, Any]:
        """Counts that identify the hardware (part of the hardware fingerprint)."""
        cpus = [cpu for c in self.cores for cpu in c.cpus]
        return {
            "packages": len({c.package for c in self.cores}),
            "physical_cores": len(self.cores),
            "logical_cpus": len(cpus),
            "threads_per_core": max((len(c.cpus) for c in self.cores), default=0),
            "source": self.source,
        }


def read_cpu_topology(cpus: Iterable[int] | None = None, root: Path = SYSFS_CPU) -> CpuTopology:
    """Group logical CPUs (default: those we may use) into physical cores through sysfs.

    Siblings come from ``cpuN/topology/thread_siblings_list`` (only those in ``cpus`` are
    kept), the socket from ``physical_package_id``. Where sysfs cannot be read (not Linux,
    a container hiding it) every CPU is assumed to be its own core, and ``source`` says so.
    """
    wanted = sorted(set(available_cores() if cpus is None else cpus))
    groups: dict[tuple[int, tuple[int, ...]], int] = {}
    try:
        for cpu in wanted:
            topo = root / f"cpu{cpu}" / "topology"
            package = int((topo / "physical_package_id").read_text())
            core_id = int((topo / "core_id").read_text())
            siblings = tuple(_cpu_list((topo / "thread_siblings_list").read_text()))
            groups.setdefault((package, siblings), core_id)
    except (OSError, ValueError) as e:
        reason = f"assumed: no sysfs topology ({type(e).__name__}); one core per logical CPU"
        return CpuTopology(tuple(PhysicalCore(0, c, (c,)) for c in wanted), reason)
    keep = set(wanted)
    cores = [PhysicalCore(pkg, core_id, tuple(c for c in sib if c in keep))
             for (pkg, sib), core_id in groups.items()]
    return CpuTopology(tuple(sorted(cores, key=lambda c: (c.package, c.core_id, c.cpus))))


def allot_cores(topology: CpuTopology, workers: int, threads: int) -> list[list[PhysicalCore]]:
    """``threads`` whole physical cores for each of ``workers``, none shared.

    A worker takes its cores from one package where one has enough left (the lowest such),
    else from the packages in order. Raises ``RigError`` when there are too few cores.
    """
    need, have = workers * threads, len(topology.cores)
    if need > have:
        logical = sum(len(c.cpus) for c in topology.cores)
        smt = f" ({logical} logical CPUs: hyper-thread siblings stay with their core)" \
            if logical > have else ""
        raise RigError(
            f"a cpu rig of {workers} workers x {threads} threads needs {need} physical cores "
            f"(one per thread, never shared between workers); this machine lets us use "
            f"{have}{smt}. Ask for fewer --devices or --threads-per-worker"
        )
    free = list(topology.cores)
    out: list[list[PhysicalCore]] = []
    for _ in range(workers):
        packages = sorted({c.package for c in free})
        home = next((p for p in packages if sum(c.package == p for c in free) >= threads), None)
        pool = [c for c in free if c.package == home] if home is not None else free
        mine = pool[:threads]
        out.append(mine)
        free = [c for c in free if c not in mine]
    return out


# --- What lies between a cuda rig's GPUs beyond NVML's view: the IOMMU, PCIe ACS ---------

SYSFS_IOMMU = Path("/sys/class/iommu")
PROC_CMDLINE = Path("/proc/cmdline")
SYSFS_PCI = Path("/sys/bus/pci/devices")
IOMMU_FLAGS = ("intel_iommu=", "amd_iommu=", "iommu=", "iommu.passthrough=")
"""The kernel command line's IOMMU settings (``iommu=pt``: passthrough, DMA not remapped)."""
ACS_CAP_ID = 0x000D
"""PCIe extended capability id of Access Control Services (PCIe base spec 7.7.11)."""
ACS_REDIRECT = {"ReqRedir": 0x4, "CmpltRedir": 0x8}
"""ACS control bits that send peer-to-peer requests up to the root complex: where a bridge
between two GPUs sets them, P2P goes through the CPU, or hangs (NVIDIA/nccl#2079)."""


def iommu_state(sysfs: Path = SYSFS_IOMMU, cmdline: Path = PROC_CMDLINE) -> dict[str, Any]:
    """The IOMMU as this OS shows it: ``state`` ``on`` (remapping DMA: /sys/class/iommu has
    units and the command line does not ask for passthrough), ``passthrough`` (``iommu=pt``),
    ``off`` (no unit) or ``unknown`` (neither can be read); ``cmdline``: its IOMMU flags."""
    try:
        flags = [f for f in cmdline.read_text().split() if f.startswith(IOMMU_FLAGS)]
    except OSError:
        flags = []
    try:
        units = sorted(p.name for p in sysfs.iterdir())
    except OSError:
        units = None
    passthrough = any(f == "iommu.passthrough=1" or f.endswith(("=pt", ",pt"))
                      for f in flags)
    off = any(f.endswith("=off") for f in flags)
    if units is None:
        state = "passthrough" if passthrough else "off" if off else "unknown"
    else:
        state = "passthrough" if units and passthrough else "on" if units else "off"
    return {"state": state, "units": units, "cmdline": flags}


def sysfs_bdf(bus_id: str) -> str:
    """NVML's bus id (``00000000:3B:00.0``) as sysfs names the device (``0000:3b:00.0``)."""
    domain, rest = bus_id.split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


def upstream_bridges(bdf: str, root: Path = SYSFS_PCI) -> list[str]:
    """The PCI bridges between the root complex and device ``bdf``, nearest the root first
    (the path sysfs links the device under)."""
    try:
        parts = (root / bdf).resolve(strict=True).parts
    except OSError:
        return []
    return [p for p in parts[:-1] if len(p) == 12 and p[4] == ":" and p[7] == ":"]


def acs_control(config: bytes) -> int | None:
    """The ACS control register from a device's PCI config space (None: no ACS capability,
    or only the first 256 bytes readable, as sysfs gives a user that is not root)."""
    offset, seen = 0x100, 0
    while 0x100 <= offset <= len(config) - 8 and seen < 64:
        header = int.from_bytes(config[offset:offset + 4], "little")
        if header == 0 or header == 0xFFFFFFFF:
            return None
        if header & 0xFFFF == ACS_CAP_ID:
            return int.from_bytes(config[offset + 6:offset + 8], "little")
        offset, seen = header >> 20, seen + 1
    return None


def _lspci_acs(bdf: str, lspci: str | None, timeout_s: float = 10.0) -> int | None:
    """ACSCtl from ``lspci -vvv -s BDF`` (shown only where lspci may read extended config
    space, as root), as control bits; None where it shows none."""
    if lspci is None:
        return None
    try:
        out = subprocess.run([lspci, "-vvv", "-s", bdf], capture_output=True, text=True,
                             timeout=timeout_s, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    line = next((ln for ln in out.splitlines() if "ACSCtl:" in ln), None)
    if line is None:
        return None
    return sum(bit for name, bit in ACS_REDIRECT.items() if f"{name}+" in line)


def acs_state(bus_ids: Sequence[str], root: Path = SYSFS_PCI,
              lspci: str | None = None) -> dict[str, Any]:
    """PCIe ACS redirection on the bridges above the GPUs (``bus_ids``, NVML's): ``state``
    ``on`` (a bridge redirects peer requests), ``off`` (every bridge with ACS was read and
    none does) or ``unknown`` (nothing readable: config space beyond 256 bytes needs root,
    lspci may be absent); ``bridges``: bdf -> the redirect bits set, as lspci names them."""
    lspci = lspci if lspci is not None else shutil.which("lspci")
    bridges: dict[str, str] = {}
    for bdf in dict.fromkeys(b for bus in bus_ids for b in upstream_bridges(sysfs_bdf(bus),
                                                                           root)):
        try:
            control = acs_control((root / bdf / "config").read_bytes())
        except OSError:
            control = None
        control = control if control is not None else _lspci_acs(bdf, lspci)
        if control is not None:
            bridges[bdf] = " ".join(f"{n}+" for n, bit in ACS_REDIRECT.items()
                                    if control & bit) or "no redirect"
    if not bridges:
        return {"state": "unknown", "bridges": {}}
    redirect = any(v != "no redirect" for v in bridges.values())
    return {"state": "on" if redirect else "off", "bridges": bridges}


PCIE_WORDS = {"BOARD": "one board", "PIX": "one PCIe switch", "PXB": "PCIe switches",
              "PHB": "PCIe host bridge", "NODE": "host bridges of one NUMA node",
              "SYS": "across sockets"}
"""``nvidia-smi topo -m``'s path names (env.json ``pcie_common_ancestor``) in words."""


def gpu_link_line(topology: Mapping[str, Any], iommu: Mapping[str, Any],
                  acs: Mapping[str, Any]) -> str | None:
    """One line naming how a cuda rig's GPUs reach each other (``topology``:
    ``environment.gpu_topology``'s record): ``2 GPUs: PCIe host bridge, P2P read/write ok,
    no NVLink, IOMMU off, ACS unknown``. None under two GPUs or without NVML."""
    gpus, pairs = topology.get("gpus") or [], topology.get("pairs") or {}
    if len(gpus) < 2 or not pairs:
        return None
    paths = dict.fromkeys(PCIE_WORDS.get(str(p.get("pcie_common_ancestor")).split()[0],
                                         "PCIe path unknown") for p in pairs.values())
    bad = {f"P2P {cap} {status}" for p in pairs.values()
           for cap, status in (p.get("p2p") or {}).items()
           if cap in ("read", "write") and status != "ok"}
    nvlink = sorted({str(p["link"]) for p in pairs.values()
                     if str(p.get("link")).startswith("NVLink")})
    words = ["/".join(paths), ", ".join(sorted(bad)) or "P2P read/write ok",
             ", ".join(nvlink) or "no NVLink", f"IOMMU {iommu.get('state', 'unknown')}",
             f"ACS {acs.get('state', 'unknown')}"]
    return f"{len(gpus)} GPUs: {', '.join(words)}"
