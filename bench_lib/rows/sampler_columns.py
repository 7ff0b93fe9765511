"""The columns read from the devices' samples (``measure.sampler``) over a case's timed
windows: utilisation, power and energy (``window_columns``), where they are left empty
(``energy_left_empty``, ``unsampled_nodes``), and the utilisation read against the case's
own compute (``util_check_columns``)."""

from __future__ import annotations

from collections.abc import Sequence

from bench_lib.analysis import utilisation
from bench_lib.launch.protocol import CaseOutcome, SampleRow
from bench_lib.measure.energy import MIN_SAMPLES, MIN_WINDOW_S
from bench_lib.results.cells import Row, by_device
from bench_lib.rig import Rig
from bench_lib.rows.waterfall import device_compute_s
from bench_lib.sweep.cases import Case


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
