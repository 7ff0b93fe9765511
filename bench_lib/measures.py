"""What the runner measures beside the clock: the sampler it wraps around a case, and the
case's summary columns (utilisation, memory, energy, FLOP efficiency, speedup)."""

from __future__ import annotations

import csv
import statistics
from collections.abc import Sequence
from pathlib import Path

from bench_lib import strategies
from bench_lib.flops import efficiency, train_flops_per_image
from bench_lib.monitor import NvmlSource, ProcessSource, RaplSource, Sampler, window_summary
from bench_lib.rig import Rig
from bench_lib.sweep import Case

DEFAULT_SAMPLE_INTERVAL_MS = 100.0


def _cuda_bus_ids(count: int) -> dict[str, str | int]:
    """NVML keys of CUDA devices 0..count-1: PCI bus ids, since CUDA and NVML may order
    GPUs differently (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER)."""
    import torch

    keys: dict[str, str | int] = {}
    for i in range(count):
        p = torch.cuda.get_device_properties(i)
        keys[str(i)] = f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0"
    return keys


def case_sampler(case: Case, rig: Rig, pids: Sequence[int]) -> Sampler:
    """A sampler over the devices a case uses; device labels match peak_mem_mib's keys."""
    spec = strategies.get(case.strategy)
    n = spec.num_devices(rig)
    interval_s = case.settings.get("sample_interval_ms", DEFAULT_SAMPLE_INTERVAL_MS) / 1000
    sources: list = []
    if rig.kind == "cuda":
        try:
            sources.append(NvmlSource(_cuda_bus_ids(n)))
        except Exception:  # no NVML library or driver: the GPU columns stay empty
            pass
    else:
        if spec.per_device_processes:
            labels = [str(r) for r in range(len(pids))]
        else:  # one process drives every device of the case
            labels = ["+".join(str(i) for i in range(n))]
        sources.append(ProcessSource(dict(zip(labels, pids))))
        rapl = RaplSource()
        if rapl.available:
            sources.append(rapl)
    return Sampler(sources, interval_s)


def _by_device(values: dict[str, float]) -> str:
    return ";".join(f"{k}:{v:.1f}" for k, v in sorted(values.items()))


def _peak_tflop_s(peak: dict | None, precision: str, world: int) -> float | None:
    """The attainable peak of the devices a case uses (sum over them), if measured."""
    per_device = ((peak or {}).get("tflop_s") or {}).get(precision) or {}
    values = [per_device.get(str(i)) for i in range(world)]
    return sum(values) if values and all(v for v in values) else None


def summary_columns(case: Case, rig: Rig, outcome, peak: dict | None) -> dict:
    """cases.csv measurement columns of an ok case's outcome."""
    world = strategies.get(case.strategy).num_devices(rig)
    cols: dict = {"stop_reason": outcome.stop_reason}
    if len(outcome.window) == 2:
        images = case.batch_size * len(outcome.step_times_s)
        cols |= window_summary(outcome.samples, *outcome.window, images)
    if outcome.peak_mem_reserved_mib:
        cols["peak_mem_reserved_mib_max"] = max(outcome.peak_mem_reserved_mib.values())
        cols["peak_mem_reserved_mib_by_device"] = _by_device(outcome.peak_mem_reserved_mib)
    mem = list(outcome.peak_mem_mib.values())
    if len(mem) >= 2 and min(mem) > 0:
        cols["mem_imbalance_ratio"] = max(mem) / min(mem)
    elif world == 1 and mem:
        cols["mem_imbalance_ratio"] = 1.0
    # else: one process drove several devices and its peak cannot be split per device.
    flops = train_flops_per_image(case.model, case.image_size)
    throughput = case.batch_size / statistics.median(outcome.step_times_s)
    achieved, mfu = efficiency(flops, throughput, _peak_tflop_s(peak, case.precision, world))
    cols |= {"flops_per_img": flops, "achieved_tflop_s": achieved, "mfu_pct": mfu}
    return cols


class SpeedupTable:
    """Fills speedup_vs_single and scaling_efficiency from the `single` case of the same
    workload in the same run (expand puts `single` first in each group)."""

    def __init__(self) -> None:
        self._single: dict[tuple, float] = {}

    def seed(self, cases_csv: Path) -> None:
        """Learn the `single` rows a run folder already holds (a resumed run)."""
        if not cases_csv.is_file():
            return
        with cases_csv.open(newline="") as f:
            for r in csv.DictReader(f):
                if r["strategy"] == "single" and r["status"] == "ok" and r["throughput_img_s"]:
                    key = (r["model"], int(r["image_size"]), int(r["batch_size"]),
                           r["precision"], r["loss"])
                    self._single[key] = float(r["throughput_img_s"])

    def fill(self, case: Case, row: dict) -> None:
        if row.get("status") != "ok":
            return
        key = (case.model, case.image_size, case.batch_size, case.precision, case.loss)
        if case.strategy == "single":
            self._single[key] = row["throughput_img_s"]
        base = self._single.get(key)
        if base:
            speedup = row["throughput_img_s"] / base
            row["speedup_vs_single"] = speedup
            row["scaling_efficiency"] = speedup / row["world_size"]
