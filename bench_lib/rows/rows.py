"""A case's rows: its cases.csv row (``case_row``: its identity, its timing statistics, and
the figures derived from what the runner saw, each family of columns made by its own
module: ``rows.sampler_columns``, ``rows.bound_columns``; the speedup columns
come from ``rows.speedup_table``; its achieved TFLOP/s and MFU here: ``efficiency``,
``mfu_note``) and its steps.csv rows (``step_rows``)."""

from __future__ import annotations

import statistics

from bench_lib import turns
from bench_lib.analysis.launch_spread import describe, kernels_note, launch_spread
from bench_lib.analysis.stats import Stats, lag1_autocorr_within, launch_interval
from bench_lib.launch.protocol import CaseOutcome
from bench_lib.measure.contention import contention, cpu_per_wall
from bench_lib.measure.energy import IdlePower
from bench_lib.measure.flop_peak import AttainablePeak
from bench_lib.measure.flops import train_flops_per_image
from bench_lib.measure.throttling import throttling
from bench_lib.results.cells import Row, by_device, finite
from bench_lib.rig import Rig
from bench_lib.rows.bound_columns import bubble_columns
from bench_lib.rows.sampler_columns import energy_left_empty, unsampled_nodes, window_columns
from bench_lib.sweep.cases import Case


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
        # How to read the strategy here, and why an ok case has no timeline or lacks a
        # diagnostic.
        "note": "; ".join(filter(None, [case.note, outcome.trace_note,
                                        outcome.diagnostics_note])),
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
            "step_time_s_ci_low": finite(step.low),
            "step_time_s_ci_high": finite(step.high),
            "step_time_ci_method": step.method,
            "step_time_ci_note": step.note,
            "step_time_lag1_autocorr": finite(lag1_autocorr_within(per_launch)),
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
            "launch_spread_ratio": finite(spread.ratio),
            "launch_spread_p": finite(spread.p_value),
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
    took_turns = turns.requested_side() is not None  # the gate's other side stepped beside it
    cols: Row = {"contention": contention(load, ratio, cores, turns=took_turns)}
    if load is not None:
        cols |= {"cpu_steal_pct": round(load.cpu_steal_pct, 2),
                 "other_cpu_pct": round(load.other_cpu_pct, 2)}
    return cols


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


def memory_columns(outcome: CaseOutcome) -> Row:
    """The net peak-memory columns and how the peaks were read (empty where not measured)."""
    if not outcome.peak_mem_net_mib:
        return {}
    return {"peak_mem_net_mib_max": max(outcome.peak_mem_net_mib.values()),
            "peak_mem_net_mib_by_device": by_device(outcome.peak_mem_net_mib),
            "peak_mem_source": outcome.peak_mem_source}


def step_rows(outcome: CaseOutcome) -> list[Row]:
    """steps.csv rows: every launch's every rank's every timed step, its wall and CPU time
    and the speed probe's time before it."""
    rows = []
    for launch, part in enumerate(outcome.parts()):
        for rank, times in sorted(part.rank_step_times_s.items()):
            cpu = part.rank_step_cpu_times_s.get(rank, [])
            probe = part.rank_probe_times_s.get(rank, [])
            rows += [{"launch": launch, "rank": rank, "step": i, "step_time_s": t,
                      "cpu_time_s": cpu[i] if i < len(cpu) else "",
                      "probe_s": probe[i] if i < len(probe) else ""}
                     for i, t in enumerate(times)]
    return rows
