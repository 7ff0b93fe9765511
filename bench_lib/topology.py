"""The physical cores behind a cpu rig, and how they are handed out to its workers.

A cpu worker of T threads holds T whole *physical* cores (with their hyper-thread siblings,
read from sysfs): one thread per physical core, and no two workers ever share one, so a
worker's threads never compete with another worker's for a core's execution units.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
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
