"""Sampling devices while a case runs: NVML on GPUs, psutil and RAPL on CPU rigs.

    with Sampler([ProcessSource({"0": pid0, "1": pid1}), RaplSource()], interval_s=0.1) as s:
        ...                      # the case runs
    s.samples                    # one dict per (tick, device), columns of samples.csv

A metric a source cannot read is ``None`` (an empty CSV cell), never zero. A source that
cannot be opened (no NVML library or driver) is an ``UnavailableSource`` and one that fails
while read is dropped: either way ``Sampler.note`` says why its columns are empty. Sources
are read from a background thread in the runner (parent) process, so the sampler never runs
inside the processes it measures.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, Protocol

from bench_lib.nvml import clock_event_names, load_nvml
from bench_lib.results.schema import SAMPLE_METRIC_NAMES

MIB = 2**20
Reading = dict[str, Any]
"""One device's metrics at one tick: ``device`` and some of SAMPLE_METRIC_NAMES."""


class Source(Protocol):
    """Something the sampler reads every tick."""

    def read(self) -> list[Reading]: ...

    def close(self) -> None: ...


class UnavailableSource:
    """Stands in for a source that could not be opened: reads nothing, and says why
    (``note``, which reaches ``Sampler.note``) instead of its columns going empty silently."""

    def __init__(self, what: str, error: BaseException | str) -> None:
        why = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.note = f"{what} unavailable ({why}): its columns are empty"

    def read(self) -> list[Reading]:
        return []

    def close(self) -> None:
        pass


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
    """Per-GPU NVML counters, the SM clock, the temperature and why the clocks are where they
    are (clock event reasons: power cap, thermal, sync boost...); GPM SM utilisation and
    tensor activity where supported.

    A MIG instance (a ``MIG-...`` key) is a share of its card, and NVML's utilisation,
    power and energy are the card's (every instance's work): they are not read for it, and
    ``note`` says so. Its memory is the instance's, its GPM metrics the instance's own
    (``nvmlGpmMigSampleGet``), its clocks, temperature and clock event reasons the card's.
    """

    def __init__(self, devices: dict[str, str | int], nvml: Any = None,
                 gpm_min_span_s: float = 0.0) -> None:
        """``devices`` maps a device label to its PCI bus id (str), MIG instance UUID
        (``MIG-...``) or NVML index (int).

        GPM metrics compare two GPM samples no closer than ``gpm_min_span_s``: a tick that
        comes sooner (the sampler's first, right after opening) gets none and keeps the
        earlier sample, instead of a figure over ~0 ms. A case's sampler passes half its
        interval. Raises where NVML or a device cannot be opened, after shutting NVML down.
        """
        nvml = load_nvml(nvml)
        self._nvml = nvml
        self._gpm_min_span_s = gpm_min_span_s
        self._handles: dict[str, Any] = {}
        """label -> the GPU's handle (a MIG instance's card)."""
        self._migs: dict[str, tuple[Any, int]] = {}
        """label -> its MIG instance's device handle and GPU instance id."""
        self._gpm_prev: dict[str, tuple[Any, float] | None] = {}
        self._closed = False
        nvml.nvmlInit()
        try:
            for label, key in devices.items():
                if isinstance(key, str) and key.startswith("MIG-"):
                    mig = nvml.nvmlDeviceGetHandleByUUID(key)
                    self._handles[label] = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
                    self._migs[label] = (mig, int(nvml.nvmlDeviceGetGpuInstanceId(mig)))
                elif isinstance(key, str):
                    self._handles[label] = nvml.nvmlDeviceGetHandleByPciBusId(key)
                else:
                    self._handles[label] = nvml.nvmlDeviceGetHandleByIndex(key)
            for label in self._handles:
                sample = self._gpm_sample(label)
                self._gpm_prev[label] = None if sample is None else (sample, time.monotonic())
        except BaseException:  # a handle lookup failed: leak neither an init nor a sample
            self.close()
            raise

    @property
    def note(self) -> str:
        """Why some of a device's columns are empty by design (``Sampler.note``): a MIG
        instance's card counters; "" where none is."""
        if not self._migs:
            return ""
        return (f"device {', '.join(sorted(self._migs))} is a MIG instance: NVML's "
                "utilisation, power and energy are its whole card's (every instance's "
                "work), so they are not read; its utilisation is its own GPM SM activity "
                "where the card has GPM")

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """An NVML reading, or None where this GPU or driver does not provide it."""
        try:
            return fn(*args)
        except self._nvml.NVMLError:
            return None

    def _optional(self, name: str, *args: Any) -> Any:
        """``_call`` of the NVML function ``name``, or None where this pynvml lacks it."""
        fn = getattr(self._nvml, name, None)
        return None if fn is None else self._call(fn, *args)

    def _clock_events(self, handle: Any) -> str | None:
        """Why the GPU's clocks are where they are (``nvml.clock_event_names``), or None
        where NVML cannot say; through the older name where pynvml predates NVML 12.535's."""
        mask = self._optional("nvmlDeviceGetCurrentClocksEventReasons", handle)
        if mask is None:
            mask = self._optional("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        return None if mask is None else clock_event_names(int(mask))

    def _gpm_sample(self, label: str) -> Any:
        """A GPM sample of the device ``label`` (its MIG instance's own where it is one), or
        None where its GPU has no GPM."""
        nvml, handle = self._nvml, self._handles[label]
        support = self._call(nvml.nvmlGpmQueryDeviceSupport, handle)
        if support is None or not support.isSupportedDevice:
            return None
        sample = self._call(nvml.nvmlGpmSampleAlloc)
        if sample is None:
            return None
        got = (self._call(nvml.nvmlGpmMigSampleGet, handle, self._migs[label][1], sample)
               if label in self._migs else self._call(nvml.nvmlGpmSampleGet, handle, sample))
        if got is None:
            self._call(nvml.nvmlGpmSampleFree, sample)
            return None
        return sample

    def _gpm_metrics(self, label: str) -> Reading:
        """SM utilisation and tensor activity between the previous GPM sample and this tick
        (none while the previous one is under ``gpm_min_span_s`` old)."""
        nvml, entry = self._nvml, self._gpm_prev[label]
        if entry is None:
            return {}
        prev, t_prev = entry
        if time.monotonic() - t_prev < self._gpm_min_span_s:
            return {}
        cur = self._gpm_sample(label)
        if cur is None:
            return {}
        t_cur = time.monotonic()
        get = nvml.c_nvmlGpmMetricsGet_t()
        get.version, get.numMetrics = nvml.NVML_GPM_METRICS_GET_VERSION, 2
        get.sample1, get.sample2 = prev, cur
        get.metrics[0].metricId = nvml.NVML_GPM_METRIC_SM_UTIL
        get.metrics[1].metricId = nvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL
        result = self._call(nvml.nvmlGpmMetricsGet, get)
        self._call(nvml.nvmlGpmSampleFree, prev)
        self._gpm_prev[label] = (cur, t_cur)
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
            mig = self._migs.get(label)
            # A MIG instance: the card's utilisation, power and energy are not its own.
            util = None if mig else self._call(nvml.nvmlDeviceGetUtilizationRates, h)
            mem = self._call(nvml.nvmlDeviceGetMemoryInfo, mig[0] if mig else h)
            power_mw = None if mig else self._call(nvml.nvmlDeviceGetPowerUsage, h)
            energy_mj = None if mig else self._call(nvml.nvmlDeviceGetTotalEnergyConsumption, h)
            rows.append({
                "device": label,
                "util_gpu_pct": None if util is None else float(util.gpu),
                "util_mem_pct": None if util is None else float(util.memory),
                "mem_used_mib": None if mem is None else mem.used / MIB,
                "power_w": None if power_mw is None else power_mw / 1000,
                "sm_clock_mhz": self._call(nvml.nvmlDeviceGetClockInfo, h, nvml.NVML_CLOCK_SM),
                "gpu_temp_c": self._optional("nvmlDeviceGetTemperature", h,
                                             getattr(nvml, "NVML_TEMPERATURE_GPU", 0)),
                "clock_event_reasons": self._clock_events(h),
                "energy_j": None if energy_mj is None else energy_mj / 1000,
                **self._gpm_metrics(label),
            })
        return rows

    def close(self) -> None:
        """Free the GPM samples and shut NVML down (once: NVML counts inits)."""
        if self._closed:
            return
        self._closed = True
        for entry in self._gpm_prev.values():
            if entry is not None:
                self._call(self._nvml.nvmlGpmSampleFree, entry[0])
        self._gpm_prev = {}
        self._call(self._nvml.nvmlShutdown)


def _read_float(path: Path) -> float | None:
    try:
        return float(path.read_text().strip())
    except (OSError, ValueError):  # root-only on most kernels since 2020
        return None


class Sampler:
    """Context manager: reads every source each ``interval_s`` on a background thread.

    A source whose ``read`` raises is not read again (its columns stay empty from then on)
    and the sampler goes on with the others; ``note`` says why a source gave nothing.
    """

    def __init__(self, sources: Sequence[Source], interval_s: float = 0.1) -> None:
        if interval_s <= 0:
            raise ValueError(f"sample interval must be positive, got {interval_s}")
        self.sources = list(sources)
        self.interval_s = interval_s
        self.samples: list[Reading] = []
        self._failed: dict[int, str] = {}  # index in sources -> why it is no longer read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)

    @property
    def note(self) -> str:
        """Why some source's columns are empty ("" when every source was read): one that
        could not be opened (``UnavailableSource``), or one whose read failed."""
        notes = [n for s in self.sources if (n := str(getattr(s, "note", "") or ""))]
        return "; ".join(notes + list(self._failed.values()))

    def __enter__(self) -> Sampler:
        self._tick()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._tick()  # a last sample, so the end of the case is covered
        for i, source in enumerate(self.sources):
            try:
                source.close()
            except Exception as e:  # a broken source must not break the case's outcome
                self._failed.setdefault(i, f"{type(source).__name__} failed to close "
                                           f"({type(e).__name__}: {e})")

    def _loop(self) -> None:
        next_t = time.monotonic() + self.interval_s
        # Event.wait sleeps, so the thread costs nothing between ticks.
        while not self._stop.wait(max(0.0, next_t - time.monotonic())):
            self._tick()
            next_t += self.interval_s

    def _tick(self) -> None:
        t = time.time()  # wall clock: comparable with the ranks' timed windows
        for i, source in enumerate(self.sources):
            if i in self._failed:
                continue
            try:
                rows = source.read()
            except Exception as e:
                self._failed[i] = (f"{type(source).__name__} read failed at "
                                   f"{time.strftime('%H:%M:%S', time.gmtime(t))} UTC and was "
                                   f"not read again ({type(e).__name__}: {e})")
                continue
            for row in rows:
                self.samples.append({"time_unix_s": t, **dict.fromkeys(SAMPLE_METRIC_NAMES), **row})
