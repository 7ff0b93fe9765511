"""The cases.csv row of a case: its identity, its timing statistics, and the figures derived
from what the runner saw (utilisation, memory, energy, FLOP efficiency, speedup)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from bench_lib.measure.flops import AttainablePeak, train_flops_per_image
from bench_lib.measure.stats import Stats
from bench_lib.rig import Rig
from bench_lib.run.protocol import CaseOutcome, SampleRow
from bench_lib.sweep.cases import Case

Row = dict[str, Any]


def by_device(values: dict[str, float]) -> str:
    """``0:812.3;1:790.1``: a per-device column's text."""
    return ";".join(f"{k}:{v:.1f}" for k, v in sorted(values.items()))


def case_row(case: Case, rig: Rig, outcome: CaseOutcome,
             attainable_peak: AttainablePeak | None = None) -> Row:
    """The cases.csv row of a case (the speedup columns come from ``SpeedupTable``)."""
    row: Row = {
        "case_id": case.case_id,
        "strategy": case.strategy,
        "model": case.model,
        "rig": rig.label,
        "world_size": case.world_size,
        "threads_per_worker": rig.threads_per_worker if rig.kind == "cpu" else "",
        "image_size": case.image_size,
        "batch_size": case.batch_size,
        "split_size": "" if case.split_size is None else case.split_size,
        # A count with no split (skipped: it does not fit the batch) keeps the count asked.
        "num_microbatches": "" if case.num_microbatches is None else case.num_microbatches,
        "precision": case.precision,
        "loss": case.loss,
        "status": outcome.status,
        "reason": outcome.reason,
        "warmup_steps": case.measurement.warmup_steps,
        "note": case.note,
        # The cut actually used (with its block indices) once run; the asked-for method before.
        "partition": outcome.partition or case.partition or "",
        "channels_last": int(case.channels_last),
        "compile": int(case.compile),
        "sync_bn": int(case.sync_bn),
    }
    if outcome.wall_time_s:
        row["case_wall_time_s"] = round(outcome.wall_time_s, 3)
    if outcome.status == "ok":
        s = Stats.of(outcome.step_times_s)
        row |= {
            "timed_steps": s.n,
            "step_time_s_median": s.median,
            "step_time_s_mean": s.mean,
            "step_time_s_stdev": s.stdev,
            "step_time_s_p10": s.p10,
            "step_time_s_p90": s.p90,
            "step_time_s_iqr": s.iqr,
            "step_time_s_ci_low": s.ci_low,
            "step_time_s_ci_high": s.ci_high,
            "throughput_img_s": case.batch_size / s.median,
            "peak_mem_mib_max": max(outcome.peak_mem_mib.values()),
            "peak_mem_mib_by_device": by_device(outcome.peak_mem_mib),
        }
        row |= derived_columns(case, outcome, row["throughput_img_s"], attainable_peak)
    return row


def derived_columns(case: Case, outcome: CaseOutcome, throughput_img_s: float,
                    attainable_peak: AttainablePeak | None) -> Row:
    """cases.csv columns derived from an ok case's outcome beside its step times."""
    cols: Row = {"stop_reason": outcome.stop_reason}
    if outcome.timed_window_unix_s is not None:
        images = case.batch_size * len(outcome.step_times_s)
        cols |= window_columns(outcome.samples, *outcome.timed_window_unix_s, images)
    if outcome.peak_mem_reserved_mib:
        cols["peak_mem_reserved_mib_max"] = max(outcome.peak_mem_reserved_mib.values())
        cols["peak_mem_reserved_mib_by_device"] = by_device(outcome.peak_mem_reserved_mib)
    mem = list(outcome.peak_mem_mib.values())
    if len(mem) >= 2 and min(mem) > 0:
        cols["mem_imbalance_ratio"] = max(mem) / min(mem)
    elif case.world_size == 1 and mem:
        cols["mem_imbalance_ratio"] = 1.0
    # else: one process drove several devices and its peak cannot be split per device.
    flops = train_flops_per_image(case.model, case.image_size)
    peak = attainable_peak.of_devices(case.precision, case.world_size) if attainable_peak else None
    achieved, mfu = efficiency(flops, throughput_img_s, peak)
    cols |= {"flops_per_img": flops, "achieved_tflop_s": achieved, "mfu_pct": mfu}
    return cols


def efficiency(flops_per_img: float, throughput_img_s: float,
               peak_tflop_s: float | None) -> tuple[float, float | None]:
    """Achieved TFLOP/s and its percentage of ``peak_tflop_s`` (None without a peak)."""
    achieved = flops_per_img * throughput_img_s / 1e12
    if not peak_tflop_s:
        return achieved, None
    return achieved, 100 * achieved / peak_tflop_s


def window_columns(samples: list[SampleRow], t0: float, t1: float, images: int) -> Row:
    """Sampler columns over the timed window [t0, t1] (unix seconds) in which ``images`` ran.

    Utilisation: the mean per device (GPU utilisation where NVML gives it, else worker CPU
    percent). Energy: each counter's mean power between its first and last sample inside the
    window, times the window's length, summed over devices, per image. Empty where the
    window holds too few samples or no counter exists.
    """
    inside = [s for s in samples if t0 <= s["time_unix_s"] <= t1]
    util: dict[str, list[float]] = {}
    energy: dict[str, list[tuple[float, float]]] = {}
    for s in inside:
        u = s["util_gpu_pct"] if s["util_gpu_pct"] is not None else s["cpu_pct"]
        if u is not None:
            util.setdefault(s["device"], []).append(u)
        if s["energy_j"] is not None:
            energy.setdefault(s["device"], []).append((s["time_unix_s"], s["energy_j"]))
    means = {d: sum(v) / len(v) for d, v in util.items()}
    out: Row = {
        "util_pct_mean_by_device": by_device(means),
        "util_pct_mean": sum(means.values()) / len(means) if means else None,
        "power_w_mean": None,
        "energy_j_per_img": None,
        "energy_source": "",
    }
    rates = [
        (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
        for pts in energy.values()
        if len(pts) >= 2 and pts[-1][0] > pts[0][0]
    ]
    if rates and len(rates) == len(energy) and images > 0:
        power = sum(rates)
        out["power_w_mean"] = power
        out["energy_j_per_img"] = power * (t1 - t0) / images
        out["energy_source"] = "rapl-host-packages" if "host" in energy else "nvml-gpus"
    return out


def step_rows(outcome: CaseOutcome) -> list[Row]:
    """steps.csv rows: every rank's every timed step."""
    return [
        {"rank": rank, "step": i, "step_time_s": t}
        for rank, times in sorted(outcome.rank_step_times_s.items())
        for i, t in enumerate(times)
    ]


class SpeedupTable:
    """Fills speedup_vs_single and scaling_efficiency from the `single` case of the same
    workload in the same run (``sweep.cases.baselines_first`` runs it first)."""

    def __init__(self) -> None:
        self._single: dict[tuple[str, int, int, str, str], float] = {}

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

    def fill(self, case: Case, row: Row) -> None:
        if row.get("status") != "ok":
            return
        if case.strategy == "single":
            self._single[case.workload_key] = row["throughput_img_s"]
        base = self._single.get(case.workload_key)
        if base:
            speedup = row["throughput_img_s"] / base
            row["speedup_vs_single"] = speedup
            row["scaling_efficiency"] = speedup / case.world_size
