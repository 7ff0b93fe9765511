"""Utilisation: which counter a device's figure comes from, and whether it agrees with the
case's own compute.

A device's utilisation over a case's timed windows is the mean of one counter's samples in
them, the first of these that the device has enough of (``MIN_SAMPLES`` in every window):

    sm_util_pct   gpm-sm-activity     NVML GPM "SM utilisation" (Hopper and later): the
                                      share of SM time with work resident, so a kernel
                                      that occupies few SMs (NCCL's use a few channels)
                                      counts for few
    util_gpu_pct  nvml-kernel-active  NVML's utilization.gpu: the share of time *some*
                                      kernel ran, however small; NCCL kernels spin while
                                      they wait for a peer, so bubbles and all-reduce waits
                                      read as busy
    cpu_pct       cpu-time            a cpu worker's CPU time over the cores it holds:
                                      compute, the collectives' reductions and copies, and
                                      threads spinning while they wait

The cross-check (``disagreement``): the case's own measure of its devices' compute, the
"timeline busy" share of a step (``rows.sampler_columns.util_check_columns``: ddp's
compute-only steps, a pipeline's passes per device in the traced step), against the
utilisation read. Over ``DISAGREE_POINTS`` apart, the row says so: the counter is then not
the devices' compute share, and the reason names what the counter counts.

Pure arithmetic on samples: no torch, no device (the layering's rule for ``analysis``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SOURCES = (("sm_util_pct", "gpm-sm-activity"), ("util_gpu_pct", "nvml-kernel-active"),
           ("cpu_pct", "cpu-time"))
"""(samples.csv column, its label in cases.csv ``util_source``), in order of preference."""
LABELS = dict(SOURCES)
MEANING = {
    "gpm-sm-activity": (
        "GPM SM activity, which counts the SMs a waiting NCCL kernel holds",
        "GPM SM activity, the share of SM time with work resident: kernels too small to "
        "fill the GPU count for part of their time"),
    "nvml-kernel-active": (
        "NVML kernel-active time, which counts any kernel running, NCCL's waiting for a "
        "peer too",
        "NVML kernel-active time: the GPU waited between kernels inside the compute passes "
        "(the host launching them, a synchronisation)"),
    "cpu-time": (
        "the workers' CPU time, which counts the collectives' reductions and copies and "
        "threads spinning while they wait",
        "the workers' CPU time: they waited for a core (the contention column) or for data "
        "inside the compute passes"),
}
"""What each source is, read above the timeline's busy share and read below it: the
reason a disagreement gives."""
DISAGREE_POINTS = 20.0
"""Utilisation and timeline busy share further apart than this (percentage points) flag
the case: what issue #28 asked; within it, sampling (a 0.1 s tick over windows of a few
seconds) and the traced step's own spread cover the difference."""


def device_means(samples: Iterable[Mapping[str, Any]],
                 windows: Sequence[tuple[float, float]],
                 min_samples: int) -> tuple[dict[str, float], dict[str, str], dict[str, int]]:
    """Each device's utilisation over ``windows`` [t0, t1] (unix seconds, one per launch):
    (mean, its source label, devices with too few samples and their fewest in a window).

    A device counts when any of its samples has some source; its source is the first of
    ``SOURCES`` with ``min_samples`` in every window, so a GPU whose GPM gave out part-way
    falls back to kernel-active rather than averaging two counters. A device with no
    source so sampled is in the third dict, with the most samples any of its sources had
    in its thinnest window."""
    inside: dict[str, dict[str, list[list[float]]]] = {}
    for s in samples:
        for column, _ in SOURCES:
            if s.get(column) is not None:
                inside.setdefault(str(s["device"]), {}).setdefault(
                    column, [[] for _ in windows])
    for s in samples:
        for column, per_window in inside.get(str(s["device"]), {}).items():
            if s.get(column) is None:
                continue
            for w, (t0, t1) in enumerate(windows):
                if t0 <= s["time_unix_s"] <= t1:
                    per_window[w].append(float(s[column]))
    means: dict[str, float] = {}
    sources: dict[str, str] = {}
    few: dict[str, int] = {}
    for device, columns in sorted(inside.items()):
        thinnest = {c: min(len(v) for v in per_window) for c, per_window in columns.items()}
        chosen = next((c for c, _ in SOURCES if thinnest.get(c, 0) >= min_samples), None)
        if chosen is None:
            few[device] = max(thinnest.values())
            continue
        pooled = [x for v in columns[chosen] for x in v]
        means[device] = sum(pooled) / len(pooled)
        sources[device] = LABELS[chosen]
    return means, sources, few


def source_text(sources: Mapping[str, str]) -> str:
    """cases.csv ``util_source``: the one label, or ``device:label;...`` where they differ."""
    labels = set(sources.values())
    if len(labels) <= 1:
        return next(iter(labels), "")
    return ";".join(f"{d}:{label}" for d, label in sorted(sources.items()))


def source_labels(text: str) -> set[str]:
    """The labels of a ``util_source`` text (``source_text``): ``{"cpu-time"}``, or each
    device's of ``0:gpm-sm-activity;1:nvml-kernel-active``; empty for empty text."""
    return {part.rsplit(":", 1)[-1] for part in text.split(";") if part}


def disagreement(util_pct: float, busy_pct: float, source: str) -> str:
    """cases.csv ``util_check``: empty where the utilisation read (``util_pct``, from
    ``source``, a ``util_source`` text) is within ``DISAGREE_POINTS`` of the timeline's busy
    share (``busy_pct``), else the two and what the counter counts beside compute."""
    gap = util_pct - busy_pct
    if abs(gap) <= DISAGREE_POINTS:
        return ""
    labels = sorted(source_labels(source) & set(MEANING))
    why = "; ".join(MEANING[label][0 if gap > 0 else 1] for label in labels)
    direction = "above" if gap > 0 else "below"
    return (f"utilisation {util_pct:.0f}% is {abs(gap):.0f} points {direction} the "
            f"{busy_pct:.0f}% of the step its own compute takes (timeline busy): not the "
            f"devices' compute share" + (f"; it is {why}" if why else ""))
