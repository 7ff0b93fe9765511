"""The cases.csv row of a case: its identity, its timing statistics, and the figures derived
from what the runner saw (utilisation, memory, energy, FLOP efficiency, speedup)."""

from __future__ import annotations

import csv
import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench_lib.analysis import bubble, utilisation
from bench_lib.analysis.bound import Bound
from bench_lib.analysis.collective_fits import Collectives
from bench_lib.analysis.launch_spread import describe, kernels_note, launch_spread
from bench_lib.analysis.stats import (
    LaunchInterval,
    Stats,
    lag1_autocorr_within,
    launch_interval,
    paired_ratio_interval,
)
from bench_lib.measure.contention import contention, cpu_per_wall
from bench_lib.measure.energy import MIN_SAMPLES, MIN_WINDOW_S, IdlePower
from bench_lib.measure.flops import AttainablePeak, train_flops_per_image
from bench_lib.measure.throttling import throttling
from bench_lib.results.schema import launch_medians
from bench_lib.rig import Rig
from bench_lib.run import case_bound
from bench_lib.run.case_parts import device_compute_s
from bench_lib.run.protocol import CaseOutcome, SampleRow
from bench_lib.sweep.cases import Case

Row = dict[str, Any]


def by_device(values: dict[str, float]) -> str:
    """``0:812.3;1:790.1``: a per-device column's text."""
    return ";".join(f"{k}:{v:.1f}" for k, v in sorted(values.items()))


def case_row(case: Case, rig: Rig, outcome: CaseOutcome,
             attainable_peak: AttainablePeak | None = None,
             idle_power: IdlePower | None = None) -> Row:
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
        "device_batch_size": case.device_batch_size,
        "batch_curve_of": "" if case.curve_of is None else case.curve_of,
        "scaling": case.scaling,
        "precision": case.precision,
        "loss": case.loss,
        "status": outcome.status,
        "reason": outcome.reason,
        # The warm-up steps run (the profile's warmup_steps is the minimum); empty untimed.
        "warmup_steps": "" if outcome.warmup_steps is None else outcome.warmup_steps,
        # How to read the strategy here, and why an ok case has no timeline.
        "note": "; ".join(filter(None, [case.note, outcome.trace_note])),
        # The cut actually used (with its block indices) once run; the asked-for method before.
        "partition": outcome.partition or case.partition or "",
        "channels_last": int(case.channels_last),
        "compile": int(case.compile),
        "sync_bn": int(case.sync_bn),
    }
    if case.ddp is not None:
        cap = case.ddp.bucket_cap_mb
        row |= {"ddp_bucket_cap_mb": "default" if cap is None else f"{cap:g}",
                "ddp_gradient_as_bucket_view": int(case.ddp.gradient_as_bucket_view),
                "ddp_static_graph": int(case.ddp.static_graph),
                "ddp_comm_hook": case.ddp.hook_label}
    if outcome.wall_time_s:
        row["case_wall_time_s"] = round(outcome.wall_time_s, 3)
    row |= contention_columns(case, rig, outcome)
    if outcome.status == "ok":
        s = Stats.of(outcome.step_times_s)  # every launch's steps pooled: the spread columns
        per_launch = outcome.launch_step_times_s()
        medians = [statistics.median(times) for times in per_launch]
        step = launch_interval(medians)  # the case's step time and its interval
        row |= {
            "launches": len(per_launch),
            "steps_per_launch": ";".join(str(len(times)) for times in per_launch),
            "launch_medians_s": ";".join(f"{m:.6g}" for m in medians),
            "timed_steps": s.n,
            "step_time_s_median": step.point,
            "step_time_s_mean": s.mean,
            "step_time_s_stdev": s.stdev,
            "step_time_s_p10": s.p10,
            "step_time_s_p90": s.p90,
            "step_time_s_iqr": s.iqr,
            "step_time_s_ci_low": _finite(step.low),
            "step_time_s_ci_high": _finite(step.high),
            "step_time_ci_method": step.method,
            "step_time_ci_note": step.note,
            "step_time_lag1_autocorr": _finite(lag1_autocorr_within(per_launch)),
            **launch_spread_columns(outcome),
            "throughput_img_s": case.batch_size / step.point,
            "peak_mem_mib_max": max(outcome.peak_mem_mib.values()),
            "peak_mem_mib_by_device": by_device(outcome.peak_mem_mib),
        }
        row |= memory_columns(outcome)
        if outcome.optimizer_step_s is not None:
            row["optimizer_step_s"] = outcome.optimizer_step_s
        # On a cpu rig a lone process driving several devices (mp, pipeline) is pinned to
        # one worker's cores: its MFU is of that one worker's peak.
        held = 1 if rig.kind == "cpu" and not case.process_group else case.world_size
        row |= derived_columns(case, outcome, row["throughput_img_s"], attainable_peak,
                               idle_power, held)
        if case.spans_nodes(rig):
            row |= unsampled_nodes(row, rig.nodes)
        if rig.gpu_slots > 1:
            row |= shared_gpus(row, case, rig)
    return row


def launch_spread_columns(outcome: CaseOutcome) -> Row:
    """Whether an ok case's launches differ beyond their steps' noise
    (``analysis.launch_spread``) and, on GPUs, whether they ran the same kernels: empty
    figures where there is no test (1 launch, too few steps)."""
    launches = outcome.launch_step_times_s()
    spread = launch_spread(launches)
    untested = spread.note if len(launches) > 1 else ""  # 1 launch: the ci note says so
    kernels = kernels_note([p.kernel_names for p in outcome.parts()])
    return {"launches_differ": int(spread.differ) if spread.tested else None,
            "launch_spread_ratio": _finite(spread.ratio),
            "launch_spread_p": _finite(spread.p_value),
            "launch_note": "; ".join(filter(None, [describe(spread), untested, kernels]))}


def shared_gpus(row: Row, case: Case, rig: Rig) -> Row:
    """The validation mode (``--gpu-slots``): the FLOP peak was probed by every slot at once,
    several on each GPU, so a slot's peak is a share of its card: MFU is left empty (the
    achieved TFLOP/s stays). A case whose slots share a GPU sampled that GPU once per slot:
    its power and energy would count the card as often (and no idle power is known for a
    second slot), so they are left empty; its utilisation, the shared card's, stays. Each
    with the reason."""
    flag = f"validation run (--gpu-slots {rig.gpu_slots})"
    cols: Row = {"mfu_pct": None, "mfu_note": (
        f"{flag}: the FLOP peak was probed by {rig.gpu_slots} slots sharing each GPU at "
        "once, so a slot's peak is a share of the card's: no MFU")}
    gpus = len({rig.cuda_index(s) for s in range(min(case.world_size, rig.num_devices))})
    if gpus < case.world_size:
        note = (f"{flag}: the case's {case.world_size} slots share {gpus} GPU"
                f"{'s' if gpus > 1 else ''}, each sampled once per slot: power and energy "
                "left empty (utilisation is the shared GPU's)")
        cols |= energy_left_empty(row, note) | {"energy_source": ""}
    return cols


def unsampled_nodes(row: Row, nodes: int) -> Row:
    """A case across ``nodes`` nodes: only node 0's devices are sampled, so its power and
    energy cover part of the case's devices while the images are all of them: left empty,
    with the reason (its utilisation, node 0's devices', stays)."""
    note = (f"only node 0 is sampled: power and energy of a case across {nodes} nodes left "
            "empty")
    return energy_left_empty(row, note)


def energy_left_empty(row: Row, note: str) -> Row:
    """The columns that leave ``row``'s power and energy empty, ``note`` added to its
    sampler note (after the sampler's own)."""
    return {"power_w_mean": None, "energy_j_per_img": None, "energy_j_per_img_net": None,
            "sampler_note": "; ".join(filter(None, [row.get("sampler_note"), note]))}


def contention_columns(case: Case, rig: Rig, outcome: CaseOutcome) -> Row:
    """Steal and other processes' CPU over the case, and whether it ran under contention
    (``measure.contention``; empty for a case that did not run).

    The per-step CPU over wall rule applies to single-process cases of a cpu rig only (a
    process pinned to one worker's T cores with no peer to wait for); distributed ranks
    wait on their peers by design.
    """
    load = outcome.machine_load
    ratio = None
    cores = rig.threads_per_worker
    cpu, wall = outcome.rank_step_cpu_times_s.get(0), outcome.rank_step_times_s.get(0)
    if (rig.kind == "cpu" and not case.process_group and outcome.status == "ok"
            and cpu and wall and len(cpu) == len(wall)):
        ratio = cpu_per_wall(cpu, wall, cores)
    if load is None and ratio is None:
        return {}
    cols: Row = {"contention": contention(load, ratio, cores)}
    if load is not None:
        cols |= {"cpu_steal_pct": round(load.cpu_steal_pct, 2),
                 "other_cpu_pct": round(load.other_cpu_pct, 2)}
    return cols


def _finite(x: float) -> float | None:
    """``x``, or None (an empty cell) where it is NaN: a figure that could not be had."""
    return None if math.isnan(x) else x


def derived_columns(case: Case, outcome: CaseOutcome, throughput_img_s: float,
                    attainable_peak: AttainablePeak | None,
                    idle_power: IdlePower | None = None, peak_devices: int | None = None) -> Row:
    """cases.csv columns derived from an ok case's outcome beside its step times.

    ``peak_devices``: how many devices' peaks the case's compute can reach (default: its
    world size).
    """
    cols: Row = {"stop_reason": outcome.stop_reason}
    windows = [w for p in outcome.parts() if (w := p.timed_window_unix_s) is not None]
    if windows:
        images = case.batch_size * len(outcome.step_times_s)
        cols |= window_columns(outcome.samples, windows, images,
                               idle_power.watts if idle_power else None)
        if outcome.sampler_note:  # a source that gave nothing says why first
            cols["sampler_note"] = "; ".join(filter(None, [outcome.sampler_note,
                                                           cols["sampler_note"]]))
        # GPU clocks held back in the windows (power cap, thermal...), as contention is said.
        cols["throttled"] = throttling(outcome.samples, windows)
    if outcome.peak_mem_reserved_mib:
        cols["peak_mem_reserved_mib_max"] = max(outcome.peak_mem_reserved_mib.values())
        cols["peak_mem_reserved_mib_by_device"] = by_device(outcome.peak_mem_reserved_mib)
    mem = list(outcome.peak_mem_net_mib.values())  # what the case adds, per device
    if len(mem) >= 2 and min(mem) > 0:
        cols["mem_imbalance_ratio"] = max(mem) / min(mem)
    elif case.world_size == 1 and mem:
        cols["mem_imbalance_ratio"] = 1.0
    # else: one process drove several devices and its peak cannot be split per device.
    flops = train_flops_per_image(case.model, case.image_size)
    held = peak_devices or case.world_size
    peak = attainable_peak.of_devices(case.precision, held) if attainable_peak else None
    achieved, mfu = efficiency(flops, throughput_img_s, peak)
    cols |= {"flops_per_img": flops, "achieved_tflop_s": achieved, "mfu_pct": mfu,
             "mfu_note": mfu_note(mfu, attainable_peak, case.precision, held)}
    cols |= bubble_columns(case, outcome, case.batch_size / throughput_img_s)
    return cols


def bubble_columns(case: Case, outcome: CaseOutcome, median_s: float) -> Row:
    """The pipeline bubble per device beside the schedule's theory, and the traced step
    against the median step (``median_s``); empty for strategies that do not pipeline."""
    ideal = bubble.theory(case.strategy, case.world_size, case.num_microbatches)
    if ideal is None:
        return {}
    cols: Row = {"bubble_theory_pct": 100 * ideal.fraction}
    idle = bubble.measured(outcome.timeline)
    if idle is not None:
        lo, hi = bubble.span(outcome.timeline)
        cols |= {"bubble_measured_pct": 100 * idle, "timeline_span_s": hi - lo}
    if outcome.traced_step_s is not None:
        cols |= {"traced_step_s": outcome.traced_step_s,
                 "traced_vs_median_pct": 100 * (outcome.traced_step_s / median_s - 1)}
    return cols


def case_bound_or_why(case: Case, rig: Rig, outcome: CaseOutcome, median_s: float | None,
                      single_s: float | None = None, collectives: Collectives | None = None,
                      ddp_compute_s: float | None = None,
                      copies: Mapping[int, float] | None = None) -> Bound | str | None:
    """The case's bound from its own parts (``run.case_bound``), why it has none, or None
    (a case not ok, a strategy without a bound). ``single_s``: the same workload's single
    median step (ddp, fsdp); ``collectives``: the run's micro-benchmark;
    ``ddp_compute_s``: for fsdp, a ddp case's measured compute of the same local batch;
    ``copies``: the workload's calibrated copy rate (fsdp's copies)."""
    if outcome.status != "ok" or not median_s:
        return None
    try:
        return case_bound.case_bound(case, rig, outcome, median_s, single_s, collectives,
                                     ddp_compute_s, copies)
    except Exception as e:  # a bound is a derived figure: never worth losing the row for
        return f"no bound: {type(e).__name__}: {e}"


def bound_columns_of(found: Bound | str | None, median_s: float | None) -> Row:
    """``found``'s columns beside the median step: empty for None."""
    if found is None or not median_s:
        return {}
    if isinstance(found, str):
        return {"bound_note": found}
    return {"step_time_s_bound": found.step_s,
            "step_time_s_bound_no_overlap": found.no_overlap_s,
            "efficiency_vs_bound_pct": 100 * found.step_s / median_s,
            "bound_compute_s": found.compute_s, "bound_bubble_s": found.bubble_s,
            "bound_comm_s": found.comm_s, "bound_other_s": found.other_s,
            "bound_note": found.note()}


def bound_columns(case: Case, rig: Rig, outcome: CaseOutcome, median_s: float | None,
                  single_s: float | None = None, collectives: Collectives | None = None,
                  ddp_compute_s: float | None = None,
                  copies: Mapping[int, float] | None = None) -> Row:
    """The bound's columns (``case_bound_or_why``, ``bound_columns_of``)."""
    return bound_columns_of(case_bound_or_why(case, rig, outcome, median_s, single_s,
                                              collectives, ddp_compute_s, copies), median_s)


def util_check_columns(case: Case, rig: Rig, outcome: CaseOutcome, row: Row,
                       optimizer_s: float | None = None,
                       ddp_compute_s: float | None = None) -> Row:
    """The utilisation read against the case's own compute (``analysis.utilisation``):
    ``util_timeline_pct``, one device's compute a step over the median step
    (``device_compute_s``), and ``util_check``, why they disagree where they do. Empty
    where the case has no such measure (single, dp: no timeline), no utilisation, or one
    cpu worker drives several devices (its utilisation is the one process's, not a
    device's)."""
    util, median = row.get("util_pct_mean"), row.get("step_time_s_median")
    if outcome.status != "ok" or util in (None, "") or not median:
        return {}
    if rig.kind == "cpu" and not case.process_group:
        return {}
    compute = device_compute_s(case, outcome, float(median), optimizer_s or 0.0,
                               ddp_compute_s)
    if compute is None:
        return {}
    busy = min(100.0, 100 * compute / float(median))
    return {"util_timeline_pct": busy,
            "util_check": utilisation.disagreement(float(util), busy,
                                                   str(row.get("util_source") or ""))}


def _number(value: object) -> float:
    """A row's number, 0 where it has none."""
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0


def memory_columns(outcome: CaseOutcome) -> Row:
    """The net peak-memory columns and how the peaks were read (empty where not measured)."""
    if not outcome.peak_mem_net_mib:
        return {}
    return {"peak_mem_net_mib_max": max(outcome.peak_mem_net_mib.values()),
            "peak_mem_net_mib_by_device": by_device(outcome.peak_mem_net_mib),
            "peak_mem_source": outcome.peak_mem_source}


def efficiency(flops_per_img: float, throughput_img_s: float,
               peak_tflop_s: float | None) -> tuple[float, float | None]:
    """Achieved TFLOP/s and its percentage of ``peak_tflop_s`` (None without a peak)."""
    achieved = flops_per_img * throughput_img_s / 1e12
    if not peak_tflop_s:
        return achieved, None
    return achieved, 100 * achieved / peak_tflop_s


def mfu_note(mfu: float | None, peak: AttainablePeak | None, precision: str,
             devices: int) -> str:
    """Why ``mfu_pct`` is empty, or a flag where it is over 100% (the case beat the peak
    probe, so the probe is not the attainable peak here: read the figure as suspect). The
    flag names the math mode the peak was measured in (``AttainablePeak.math_of``), the
    one the workers train in: a TF32 case against an IEEE peak is not the reason."""
    if mfu is None:
        why = peak.unsupported if peak is not None else ""
        return f"no attainable peak: {why or f'none measured for {precision} on these devices'}"
    if mfu > 100:
        probes = "/".join(peak.probes_of(precision, devices) if peak else []) or "peak"
        mode = (f"; peak measured in {peak.math_of(precision)}, the workers' math mode"
                if peak is not None and peak.math_mode else
                "; the math mode of the peak is not recorded")
        return (f"over 100%: the case beat the measured peak ({probes} probe), so that "
                f"probe is not the attainable peak here{mode}")
    return ""


def _plural(devices: dict[str, int]) -> str:
    return ", ".join(f"{d}: {n}" for d, n in sorted(devices.items()))


def window_columns(samples: list[SampleRow], windows: Sequence[tuple[float, float]],
                   images: int, idle_w: dict[str, float] | None = None) -> Row:
    """Sampler columns over the timed windows [t0, t1] (unix seconds; one per launch) in
    which ``images`` ran in all.

    Utilisation: the mean per device of its samples inside the windows, of the first
    counter it has enough of (``analysis.utilisation.SOURCES``: GPM SM activity, NVML
    kernel-active time, a cpu worker's CPU percent of what it holds; all 0-100), named in
    ``util_source``.
    Energy: per window, each counter's mean power between its first and last sample inside
    it, summed over counters, times the window's length; summed over windows, per image;
    net of ``idle_w`` (idle watts per counter's device label) too. Left empty, with the
    reason in ``sampler_note``, where a window is shorter than ``MIN_WINDOW_S``, a device
    (counter) has fewer than ``MIN_SAMPLES`` samples in one, or no counter exists.
    """
    energy: dict[str, list[list[tuple[float, float]]]] = {}
    for s in samples:  # every counter that reports, so one with no sample inside counts as 0
        if s["energy_j"] is not None:
            energy.setdefault(s["device"], [[] for _ in windows])
    for w, (t0, t1) in enumerate(windows):
        for s in samples:
            if s["energy_j"] is not None and t0 <= s["time_unix_s"] <= t1:
                energy[s["device"]][w].append((s["time_unix_s"], s["energy_j"]))
    out: Row = {
        "util_pct_mean_by_device": "",
        "util_pct_mean": None,
        "util_source": "",
        "power_w_mean": None,
        "energy_j_per_img": None,
        "energy_j_per_img_net": None,
        "energy_source": "",
        "sampler_note": "",
    }
    shortest = min(t1 - t0 for t0, t1 in windows)
    if shortest < MIN_WINDOW_S:
        out["sampler_note"] = (f"timed window {shortest:.2f} s is under {MIN_WINDOW_S:g} s "
                               "(NVML averages over up to 1 s): utilisation and energy left "
                               "empty (--min-time-s sets a launch's minimum)")
        return out
    notes = []
    means, sources, few = utilisation.device_means(samples, windows, MIN_SAMPLES)
    if few:
        notes.append(f"samples in the timed window per device ({_plural(few)}) under "
                     f"{MIN_SAMPLES}: utilisation left empty")
    elif means:
        out["util_pct_mean_by_device"] = by_device(means)
        out["util_pct_mean"] = sum(means.values()) / len(means)
        out["util_source"] = utilisation.source_text(sources)
    short = {d: min(len(p) for p in per) for d, per in energy.items()
             if any(len(p) < MIN_SAMPLES or p[-1][0] <= p[0][0] for p in per)}
    if not energy:
        notes.append("no readable energy counter")
    elif short:
        notes.append(f"energy counter samples in the timed window ({_plural(short)}) under "
                     f"{MIN_SAMPLES}: energy left empty")
    elif images > 0:
        span = sum(t1 - t0 for t0, t1 in windows)
        joules = {d: sum((p[-1][1] - p[0][1]) / (p[-1][0] - p[0][0]) * (t1 - t0)
                         for p, (t0, t1) in zip(per, windows))
                  for d, per in energy.items()}
        total = sum(joules.values())
        out["power_w_mean"] = total / span
        out["energy_j_per_img"] = total / images
        out["energy_source"] = "rapl-rig-packages" if "host" in energy else "nvml-gpus"
        if idle_w is not None and all(d in idle_w for d in joules):
            idle = sum(idle_w[d] for d in joules)
            out["energy_j_per_img_net"] = (total - idle * span) / images
        else:
            notes.append("no idle power measured for these counters: net energy left empty")
    out["sampler_note"] = "; ".join(notes)
    return out


def step_rows(outcome: CaseOutcome) -> list[Row]:
    """steps.csv rows: every launch's every rank's every timed step, its wall and CPU time."""
    rows = []
    for launch, part in enumerate(outcome.parts()):
        for rank, times in sorted(part.rank_step_times_s.items()):
            cpu = part.rank_step_cpu_times_s.get(rank, [])
            rows += [{"launch": launch, "rank": rank, "step": i, "step_time_s": t,
                      "cpu_time_s": cpu[i] if i < len(cpu) else ""}
                     for i, t in enumerate(times)]
    return rows


class SpeedupTable:
    """Fills the speedup columns from the ``single`` case of the same workload in the same
    run (``sweep.cases.baselines_first`` puts it first): the speedup is single's launch
    medians over the case's, paired by round (``paired_ratio_interval``), with its interval,
    times the case's images per step over single's (1 under strong scaling, the world size
    under weak: a throughput ratio); scaling efficiency is the speedup over the world size.

    A batch-curve point (``Case.curve_of``) gets no speedup: it is compared with the
    ``single`` case of its workload's full batch, per image (``per_image_efficiency``). It
    is kept as the ``single`` of its own batch, which no case of the sweep has (else there
    would be no point): ``single_steps`` gives the curve to the waterfall.
    """

    def __init__(self) -> None:
        self._single: dict[tuple[str, int, int, str, str], list[float]] = {}
        self._steps: dict[tuple[str, int, int, str, str], float] = {}
        """Each ``single`` row's ``step_time_s_median``, by workload key."""

    def seed(self, cases_csv: Path) -> None:
        """Learn the `single` rows a run folder already holds (a resumed run)."""
        if not cases_csv.is_file():
            return
        with cases_csv.open(newline="") as f:
            for r in csv.DictReader(f):
                if r["strategy"] == "single" and r["status"] == "ok" and r["launch_medians_s"]:
                    key = (r["model"], int(r["image_size"]), int(r["batch_size"]),
                           r["precision"], r["loss"])
                    self._single[key] = launch_medians(r["launch_medians_s"])
                    self._learn_step(key, r.get("step_time_s_median"))

    def fill(self, case: Case, row: Row) -> None:
        if row.get("status") != "ok":
            return
        medians = launch_medians(row["launch_medians_s"])
        if case.strategy == "single":
            self._single[case.workload_key] = medians
            self._learn_step(case.workload_key, row.get("step_time_s_median"))
        if case.curve_of is not None:
            full = self._single.get(case.group_key)
            if full:
                rounds = min(len(full), len(medians))
                row |= efficiency_columns(
                    paired_ratio_interval(full[:rounds], medians[:rounds]),
                    case.batch_size / case.curve_of)
            return
        base = self._single.get(case.workload_key)
        if not base:
            return
        rounds = min(len(base), len(medians))
        # Throughput over single's: under weak scaling the case steps through more images.
        images = case.batch_size / case.workload_batch
        speedup = paired_ratio_interval(base[:rounds], medians[:rounds])
        row |= speedup_columns(dataclasses.replace(
            speedup, point=speedup.point * images, low=speedup.low * images,
            high=speedup.high * images), case.world_size)

    def single_step_s(self, case: Case) -> float | None:
        """The median step of the ``single`` case of ``case``'s workload, if known."""
        base = self._single.get(case.workload_key)
        return launch_interval(base).point if base else None

    def _learn_step(self, key: tuple[str, int, int, str, str], step: object) -> None:
        if step not in (None, ""):
            self._steps[key] = float(step)  # type: ignore[arg-type]

    def single_steps(self, case: Case) -> dict[int, float]:
        """single's median step per batch for ``case``'s model, image size, precision and
        loss: its full batch and its batch curve, as far as measured so far."""
        same = (case.model, case.image_size, case.precision, case.loss)
        return {batch: step for (model, image, batch, precision, loss), step in self._steps.items()
                if (model, image, precision, loss) == same}


SPEEDUP_COLUMNS = ("speedup_vs_single", "speedup_ci_low", "speedup_ci_high",
                   "speedup_ci_note", "scaling_efficiency")
"""The columns ``speedup_columns`` fills (``run.merge`` clears them before filling again)."""


EFFICIENCY_COLUMNS = ("per_image_efficiency", "per_image_efficiency_ci_low",
                      "per_image_efficiency_ci_high")
"""The columns ``efficiency_columns`` fills in a batch-curve row."""


def efficiency_columns(step_ratio: LaunchInterval, batch_ratio: float) -> Row:
    """A batch-curve row's per-image efficiency: full-batch single's step over this row's
    (``step_ratio``, paired by round) times this row's batch over the full one."""
    return {
        "per_image_efficiency": step_ratio.point * batch_ratio,
        "per_image_efficiency_ci_low": _finite(step_ratio.low * batch_ratio),
        "per_image_efficiency_ci_high": _finite(step_ratio.high * batch_ratio),
    }


def speedup_columns(speedup: LaunchInterval, world_size: int) -> Row:
    """The speedup columns of a row from its paired interval (``SPEEDUP_COLUMNS``)."""
    return {
        "speedup_vs_single": speedup.point,
        "speedup_ci_low": _finite(speedup.low),
        "speedup_ci_high": _finite(speedup.high),
        "speedup_ci_note": speedup.note,
        "scaling_efficiency": speedup.point / world_size,
    }
