"""The pipeline bubble, per device and per schedule: measured from a timeline, and in theory.

Pure Python, no torch: the runner fills cases.csv from it (``rows.bound_columns``) and the
report draws with it (``report.gantt``), so both read one definition.

Measured. A *device* is a rank's device in the distributed schedules, or a device slot of
the one process of ``mp``/``pipeline`` (timeline rows are keyed by (rank, device), and the
worker labels slots ``cpu:0``/``cpu:1`` on a cpu rig, where every torch device says "cpu").
A device is busy while it runs any stage's fwd, bwd or wgt interval (overlaps counted once);
its idle share is ``1 - busy / span``, where the span is the traced step's, first start to
last end over all devices. The case's figure is the mean over its devices::

    device 0 |F0|F1|F2|F3|          |B3|B2|B1|B0|      idle 3 of 11 units
    device 1    |F0|F1|F2|F3|B3|B2|B1|B0|              idle 3 of 11 units

Theory (``theory``), with p devices, v stages per device, m micro-batches, and the ideal
step of the published analyses: equal forward, input-gradient and weight-gradient times
(T_F = T_B = T_W, so a full backward takes 2 T_F) and free communication. Every figure is
the same quantity as the measured one, the idle share of the step's span (a "bubble rate"
of idle over busy time, as the papers quote it, is r; its share of the span is r/(1+r)):

    mp                 (p-1)/p              one micro-batch crosses the devices in turn
    pipeline, gpipe    (p-1)/(m+p-1)        fill and drain of p-1 slots of F and of B
    1f1b               (p-1)/(m+p-1)        same bubble as GPipe, less memory
    interleaved-1f1b   (p-1)/(v*m+p-1)      Narayanan et al. 2021: rate (p-1)/(v*m)
    interleaved-zb     (p-1)/(3*v*m+p-1)    W passes fill the tail: 1/3 of 1F1B's bubble
    zbv                (p-1)/(3*v*m+p-1)    only the fill, (p-1) T_F at v = 2

The zero-bubble figures. Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024,
arXiv 2401.10241): ZB-H1 (the paper's ZB1P, what torch's ``ScheduleInterleavedZeroBubble``
implements, here with v = 2 stages per rank) leaves a bubble of (p-1)(T_F + T_B - T_W),
one third of 1F1B's (p-1)(T_F + T_B + T_W) when T_F = T_B = T_W: a bubble rate of (p-1)/(3m)
in the authors' table (sail-sg, "Comparison assuming T_F=T_B=T_W"). With v stages per rank
every pass is 1/v as long, hence (p-1)/(3*v*m+p-1) of the span. ZB-V (the same paper's
section 6, and "Pipeline Parallelism with Controllable Memory", Qi et al., NeurIPS 2024)
is published as *zero* bubble under T_F = T_B = T_W: each device is busy without a gap
from its own first pass to its own last. Over the step's span the pipeline fill remains:
device r starts r chunk forwards (T_F/v each) after the step starts and ends p-1-r of them
before it ends, so every device idles (p-1) T_F/v of a span of 3 m T_F + (p-1) T_F/v,
which is (p-1)/(3*v*m+p-1) at v = 2: the same share as the interleaved zero-bubble
schedule, whose idle sits on the first devices' tails instead. tests/test_bubble.py checks
every multi-stage figure against torch's own action lists, simulated at T_F = T_B = T_W.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Event = Mapping[str, Any]
"""One timeline row: rank, stage, device, microbatch, phase, start_s, end_s."""

PHASES = ("fwd", "bwd", "wgt")
"""forward; input-gradient (or the whole backward where it is not split); weight-gradient."""


@dataclass(frozen=True)
class Schedule:
    """What the theory needs to know about a pipelined strategy."""

    stages_per_device: int
    """v: stages each device runs (``strategies.schedules`` places 2 per rank for the
    interleaved and V schedules; tests check the two agree)."""
    w_split: bool
    """True when backward is split into input- and weight-gradient passes (zero bubble)."""
    formula: str
    """The idle share of the span in p, v, m (see the module docstring)."""


_GPIPE = "(p-1)/(m+p-1)"
SCHEDULES: dict[str, Schedule] = {
    "mp": Schedule(1, False, "(p-1)/p"),
    "pipeline": Schedule(1, False, _GPIPE),
    "gpipe": Schedule(1, False, _GPIPE),
    "1f1b": Schedule(1, False, _GPIPE),
    "interleaved-1f1b": Schedule(2, False, "(p-1)/(v*m+p-1)"),
    "interleaved-zb": Schedule(2, True, "(p-1)/(3*v*m+p-1)"),
    "zbv": Schedule(2, True, "(p-1)/(3*v*m+p-1)"),
}
"""Every strategy whose cases have a pipeline timeline and a theoretical bubble."""


@dataclass(frozen=True)
class Theory:
    """A schedule's ideal idle share of the step's span, and how it was computed."""

    fraction: float
    formula: str
    p: int
    """Devices."""
    v: int
    """Stages per device."""
    m: int
    """Micro-batches per step."""

    def describe(self) -> str:
        """``(p-1)/(v*m+p-1), p=2 v=2 m=4``."""
        return f"{self.formula}, p={self.p} v={self.v} m={self.m}"


def theory(strategy: str, devices: int, microbatches: int | None) -> Theory | None:
    """The theoretical bubble of ``strategy`` on ``devices`` devices (None: not pipelined)."""
    schedule = SCHEDULES.get(strategy)
    if schedule is None or devices < 1:
        return None
    # mp has no micro-batches: the whole batch crosses the devices once, GPipe at m = 1.
    p, v, m = devices, schedule.stages_per_device, 1 if strategy == "mp" else microbatches or 1
    passes = 3 * v * m if schedule.w_split else v * m  # busy time in units of one bubble slot
    return Theory((p - 1) / (passes + p - 1), schedule.formula, p, v, m)


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the intervals, overlaps counted once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def device_key(event: Event) -> tuple[int, str]:
    """The device an interval ran on: (rank, device label)."""
    return int(event.get("rank", 0)), str(event["device"])


def span(events: Iterable[Event]) -> tuple[float, float]:
    """First start and last end over all devices (0, 0 for no events)."""
    rows = list(events)
    if not rows:
        return 0.0, 0.0
    return min(float(e["start_s"]) for e in rows), max(float(e["end_s"]) for e in rows)


def idle_by_device(events: Iterable[Event]) -> dict[tuple[int, str], float]:
    """Each device's idle share of the step's span: 1 - (union of its intervals) / span."""
    rows = list(events)
    lo, hi = span(rows)
    if hi <= lo:
        return {}
    busy: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in rows:
        busy.setdefault(device_key(e), []).append((float(e["start_s"]), float(e["end_s"])))
    return {k: 1.0 - union_length(v) / (hi - lo) for k, v in sorted(busy.items())}


def measured(events: Iterable[Event]) -> float | None:
    """The mean over devices of their idle share (None for an empty timeline)."""
    idle = idle_by_device(events)
    return sum(idle.values()) / len(idle) if idle else None
