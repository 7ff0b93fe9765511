"""Sampling devices while a case runs: NVML on GPUs, psutil and RAPL on CPU rigs.

    with Sampler([ProcessSource({"0": pid0, "1": pid1}), RaplSource()], interval_s=0.1) as s:
        ...                      # the case runs
    s.samples                    # one dict per (tick, device), columns of samples.csv

A metric a source cannot read is ``None`` (an empty CSV cell), never zero. Sources are
read from a background thread in the runner (parent) process, so the sampler never runs
inside the processes it measures.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, Protocol

from bench_lib.results.schema import SAMPLE_METRIC_NAMES

MIB = 2**20
Reading = dict[str, Any]
"""One device's metrics at one tick: ``device`` and some of SAMPLE_METRIC_NAMES."""


class Source(Protocol):
    """Something the sampler reads every tick."""

    def read(self) -> list[Reading]: ...

    def close(self) -> None: ...
POWERCAP = Path("/sys/class/powercap")
_PACKAGE_DOMAIN = re.compile(r"^[a-z-]*rapl:\d+$")  # packages, not their sub-domains


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
            # CPU percent over the last interval; the first tick has no interval yet.
            if device in self._last:
                t_prev, busy_prev = self._last[device]
                if now > t_prev:
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


class NvmlSource:
    """Per-GPU NVML counters; GPM SM utilisation and tensor activity where supported."""

    def __init__(self, devices: dict[str, str | int], nvml: Any = None) -> None:
        """``devices`` maps a device label to its PCI bus id (str) or NVML index (int)."""
        if nvml is None:
            import pynvml  # provided by nvidia-ml-py

            nvml = pynvml
        self._nvml = nvml
        nvml.nvmlInit()
        self._handles: dict[str, Any] = {}
        for label, key in devices.items():
            if isinstance(key, str):
                self._handles[label] = nvml.nvmlDeviceGetHandleByPciBusId(key)
            else:
                self._handles[label] = nvml.nvmlDeviceGetHandleByIndex(key)
        self._gpm_prev = {label: self._gpm_sample(h) for label, h in self._handles.items()}

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """An NVML reading, or None where this GPU or driver does not provide it."""
        try:
            return fn(*args)
        except self._nvml.NVMLError:
            return None

    def _gpm_sample(self, handle: Any) -> Any:
        nvml = self._nvml
        support = self._call(nvml.nvmlGpmQueryDeviceSupport, handle)
        if support is None or not support.isSupportedDevice:
            return None
        sample = self._call(nvml.nvmlGpmSampleAlloc)
        return None if sample is None else self._call(nvml.nvmlGpmSampleGet, handle, sample)

    def _gpm_metrics(self, label: str, handle: Any) -> Reading:
        """SM utilisation and tensor activity between the previous tick and this one."""
        nvml, prev = self._nvml, self._gpm_prev[label]
        if prev is None:
            return {}
        cur = self._gpm_sample(handle)
        if cur is None:
            return {}
        get = nvml.c_nvmlGpmMetricsGet_t()
        get.version, get.numMetrics = nvml.NVML_GPM_METRICS_GET_VERSION, 2
        get.sample1, get.sample2 = prev, cur
        get.metrics[0].metricId = nvml.NVML_GPM_METRIC_SM_UTIL
        get.metrics[1].metricId = nvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL
        result = self._call(nvml.nvmlGpmMetricsGet, get)
        self._call(nvml.nvmlGpmSampleFree, prev)
        self._gpm_prev[label] = cur
        if result is None:
            return {}
        m = result.metrics
        ok = nvml.NVML_SUCCESS
        return {
            "sm_util_pct": m[0].value if m[0].nvmlReturn == ok else None,
            "tensor_active_pct": m[1].value if m[1].nvmlReturn == ok else None,
        }

    def read(self) -> list[Reading]:
        nvml, rows = self._nvml, []
        for label, h in self._handles.items():
            util = self._call(nvml.nvmlDeviceGetUtilizationRates, h)
            mem = self._call(nvml.nvmlDeviceGetMemoryInfo, h)
            power_mw = self._call(nvml.nvmlDeviceGetPowerUsage, h)
            energy_mj = self._call(nvml.nvmlDeviceGetTotalEnergyConsumption, h)
            rows.append({
                "device": label,
                "util_gpu_pct": None if util is None else float(util.gpu),
                "util_mem_pct": None if util is None else float(util.memory),
                "mem_used_mib": None if mem is None else mem.used / MIB,
                "power_w": None if power_mw is None else power_mw / 1000,
                "sm_clock_mhz": self._call(nvml.nvmlDeviceGetClockInfo, h, nvml.NVML_CLOCK_SM),
                "energy_j": None if energy_mj is None else energy_mj / 1000,
                **self._gpm_metrics(label, h),
            })
        return rows

    def close(self) -> None:
        for sample in self._gpm_prev.values():
            if sample is not None:
                self._call(self._nvml.nvmlGpmSampleFree, sample)
        self._call(self._nvml.nvmlShutdown)


def _read_float(path: Path) -> float | None:
    try:
        return float(path.read_text().strip())
    except (OSError, ValueError):  # root-only on most kernels since 2020
        return None


class Sampler:
    """Context manager: reads every source each ``interval_s`` on a background thread."""

    def __init__(self, sources: Sequence[Source], interval_s: float = 0.1) -> None:
        if interval_s <= 0:
            raise ValueError(f"sample interval must be positive, got {interval_s}")
        self.sources = list(sources)
        self.interval_s = interval_s
        self.samples: list[Reading] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._tick()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._tick()  # a last sample, so the end of the case is covered
        for source in self.sources:
            source.close()

    def _loop(self) -> None:
        next_t = time.monotonic() + self.interval_s
        # Event.wait sleeps, so the thread costs nothing between ticks.
        while not self._stop.wait(max(0.0, next_t - time.monotonic())):
            self._tick()
            next_t += self.interval_s

    def _tick(self) -> None:
        t = time.time()  # wall clock: comparable with the ranks' timed windows
        for source in self.sources:
            for row in source.read():
                self.samples.append({"time_unix_s": t, **dict.fromkeys(SAMPLE_METRIC_NAMES), **row})
