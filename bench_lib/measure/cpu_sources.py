"""The sampler's sources on a cpu rig: each worker's CPU percent and resident memory through
psutil (``ProcessSource``) and the CPU packages' energy from RAPL counters
(``RaplSource``)."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Collection
from pathlib import Path

from bench_lib.measure.sampler import MIB, Reading

POWERCAP = Path("/sys/class/powercap")
_PACKAGE_DOMAIN = re.compile(r"^[a-z-]*rapl:\d+$")  # packages, not their sub-domains
CLOCK_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
"""The kernel counts a process's CPU time in these ticks (10 ms where CLK_TCK is 100)."""
MIN_CPU_INTERVAL_S = 5 * CLOCK_TICK_S
"""The shortest interval a CPU percent is taken over: one tick's rounding is then at most a
fifth of a core. A shorter one (the sampler's last tick just after a regular one, ticks
catching up after a stall) read 400-700% for one busy thread; such a read reports nothing
and the next one covers the whole time since."""


class ProcessSource:
    """Per-worker CPU percent and resident memory, through psutil.

    CPU percent is of what the worker holds: 100 = as many cores busy as the worker has
    threads (``threads_by_device``; a cpu worker holds one whole physical core per thread),
    so a device reads 0-100 like a GPU's utilisation. Without ``threads_by_device``,
    100 = one core.
    """

    def __init__(self, pids_by_device: dict[str, int],
                 threads_by_device: dict[str, int] | None = None) -> None:
        import psutil

        self._psutil = psutil
        self._cores = {d: max(1, (threads_by_device or {}).get(d, 1)) for d in pids_by_device}
        self._procs: dict[str, psutil.Process | None] = {}
        for device, pid in pids_by_device.items():
            try:
                self._procs[device] = psutil.Process(pid)
            except psutil.Error:  # already gone: its rows stay empty
                self._procs[device] = None
        self._last: dict[str, tuple[float, float]] = {}

    def read(self) -> list[Reading]:
        rows = []
        for device, proc in self._procs.items():
            row: Reading = {"device": device, "cpu_pct": None, "rss_mib": None}
            try:
                if proc is None:
                    raise AttributeError("never started")
                with proc.oneshot():
                    times, rss = proc.cpu_times(), proc.memory_info().rss
            except (self._psutil.Error, AttributeError):  # exited (or never started)
                rows.append(row)
                continue
            now, busy = time.monotonic(), times.user + times.system
            # CPU percent since the last read that gave one; the first tick has no interval
            # yet, and a read within MIN_CPU_INTERVAL_S of it keeps that read as its start.
            if device not in self._last:
                self._last[device] = (now, busy)
            elif now - self._last[device][0] >= MIN_CPU_INTERVAL_S:
                t_prev, busy_prev = self._last[device]
                row["cpu_pct"] = (100.0 * (busy - busy_prev) / (now - t_prev)
                                  / self._cores[device])
                self._last[device] = (now, busy)
            row["rss_mib"] = rss / MIB
            rows.append(row)
        return rows

    def close(self) -> None:
        pass


def rapl_package(domain: Path) -> int | None:
    """The CPU package a top-level RAPL domain measures, or None (``psys``, unreadable).

    Its ``name`` file says ``package-N`` (``package-N-die-M`` on multi-die parts); without
    one, the N of ``intel-rapl:N`` is taken as the package.
    """
    try:
        name = (domain / "name").read_text().strip()
    except OSError:
        return int(domain.name.rsplit(":", 1)[1])
    m = re.match(r"^package-(\d+)", name)
    return int(m.group(1)) if m else None


class RaplSource:
    """CPU package energy from RAPL counters, summed as device ``host``; nothing where
    unreadable. ``packages``: only the domains of these packages (those holding the rig's
    cores; None: every package domain)."""

    def __init__(self, root: Path = POWERCAP, packages: Collection[int] | None = None) -> None:
        self._domains: list[tuple[Path, float]] = []
        self.domains: list[str] = []
        """The domains read, e.g. ``intel-rapl:0 (package 0)``."""
        if root.is_dir():
            for d in sorted(root.iterdir()):
                if not _PACKAGE_DOMAIN.match(d.name) or not self._readable(d / "energy_uj"):
                    continue
                package = rapl_package(d)
                if package is None or (packages is not None and package not in packages):
                    continue
                span = _read_float(d / "max_energy_range_uj") or float("inf")
                self._domains.append((d / "energy_uj", span))
                self.domains.append(f"{d.name} (package {package})")
        self._prev: list[float | None] = [None] * len(self._domains)
        self._total_uj = 0.0

    @property
    def available(self) -> bool:
        return bool(self._domains)

    @staticmethod
    def _readable(path: Path) -> bool:
        return _read_float(path) is not None

    def read(self) -> list[Reading]:
        if not self._domains:
            return []
        for i, (path, span) in enumerate(self._domains):
            value = _read_float(path)
            if value is None:
                return [{"device": "host", "energy_j": None}]
            prev = self._prev[i]
            if prev is not None:
                # The counter wraps at max_energy_range_uj.
                self._total_uj += value - prev if value >= prev else value + span - prev
            self._prev[i] = value
        return [{"device": "host", "energy_j": self._total_uj / 1e6}]

    def close(self) -> None:
        pass


def _read_float(path: Path) -> float | None:
    try:
        return float(path.read_text().strip())
    except (OSError, ValueError):  # root-only on most kernels since 2020
        return None
