"""The sampler's source on GPUs: each GPU's NVML counters, clocks, temperature and clock
event reasons, and its GPM metrics where supported, read by PCI bus id, MIG instance or
index without a CUDA context (``NvmlSource``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bench_lib.measure.sampler import MIB, Reading
from bench_lib.nvml import clock_event_names, load_nvml


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
