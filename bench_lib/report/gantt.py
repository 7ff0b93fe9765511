"""The pipeline timeline read back from timeline.csv: the bubble per device, and a Gantt chart.

The worker records the rows (``bench_lib.measure.trace``); this half only reads them. One
chart row per device (the stages a device runs share its row, the second one hatched);
bars are coloured by phase (forward, input gradient, weight gradient) and labelled by
micro-batch. The measured idle share per device, averaged, is set beside the schedule's
theory, both from ``bench_lib.analysis.bubble`` (as are cases.csv's ``bubble_*_pct``)::

    cpu:0 |F0|F1|F2|F3|          |B3|B2|B1|B0|
    cpu:1    |F0|F1|F2|F3|B3|B2|B1|B0|
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd
from matplotlib.axes import Axes
from matplotlib.patches import Patch

from bench_lib.analysis import bubble as bubble_math
from bench_lib.analysis.bubble import Theory

PHASE_COLORS = {"fwd": "#4C72B0", "bwd": "#DD8452", "wgt": "#55A868"}
PHASE_NAMES = {"fwd": "forward", "bwd": "backward (input gradient, or all of it)",
               "wgt": "weight gradient"}
STAGE_HATCHES = ("", "//", "xx", "..")


def case_theory(case: Mapping[str, Any] | pd.Series) -> Theory | None:
    """The theoretical bubble of a cases.csv row's schedule (None: not pipelined)."""
    m = case.get("num_microbatches")
    return bubble_math.theory(str(case["strategy"]), int(case["world_size"]),
                            int(m) if m is not None and pd.notna(m) and m != "" else None)


def _records(events: pd.DataFrame) -> list[dict[str, Any]]:
    """The timeline rows as plain dicts."""
    return [{str(k): v for k, v in row.items()} for row in events.to_dict("records")]


def bubble(events: pd.DataFrame, ideal: Theory | None) -> dict[str, Any]:
    """The measured idle share per device (mean, min, max over devices) beside ``ideal``."""
    rows = _records(events)
    idle = bubble_math.idle_by_device(rows)
    lo, hi = bubble_math.span(rows)
    return {"devices": len(idle), "stages": int(events["stage"].nunique()),
            "microbatches": int(events["microbatch"].max()) + 1, "span_s": hi - lo,
            "bubble_measured": sum(idle.values()) / len(idle) if idle else float("nan"),
            "bubble_device_min": min(idle.values(), default=float("nan")),
            "bubble_device_max": max(idle.values(), default=float("nan")),
            "bubble_theoretical": ideal.fraction if ideal else float("nan"),
            "theory": ideal.describe() if ideal else "no theory for this strategy"}


def _device_label(rank: int, device: str, stages: list[int], ranks: int) -> str:
    """``cpu:0 r0`` over ``stages 0, 3`` (the rank only where there are several)."""
    head = device + (f" r{rank}" if ranks > 1 else "")
    return f"{head}\nstage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}"


def draw_gantt(ax: Axes, events: pd.DataFrame, title: str,
               ideal: Theory | None) -> dict[str, Any]:
    """One Gantt row per device: every pass it ran, coloured by phase, labelled by micro-batch."""
    by_device: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for e in _records(events):
        by_device.setdefault(bubble_math.device_key(e), []).append(e)
    t0, t1 = bubble_math.span(e for rows in by_device.values() for e in rows)
    span_ms = (t1 - t0) * 1e3
    ranks = len({rank for rank, _ in by_device})
    labels, two_stages = [], False
    for y, ((rank, device), rows) in enumerate(sorted(by_device.items())):
        stages = sorted({int(e["stage"]) for e in rows})
        two_stages |= len(stages) > 1
        labels.append(_device_label(rank, device, stages, ranks))
        for e in rows:
            left_ms, width_ms = (e["start_s"] - t0) * 1e3, (e["end_s"] - e["start_s"]) * 1e3
            hatch = STAGE_HATCHES[stages.index(int(e["stage"])) % len(STAGE_HATCHES)]
            ax.barh(y, width_ms, left=left_ms, height=0.7,
                    color=PHASE_COLORS.get(str(e["phase"]), "#8c8c8c"), edgecolor="white",
                    linewidth=0.6, hatch=hatch)
            if width_ms > 0.015 * span_ms:  # a label wider than its bar is noise
                ax.text(left_ms + width_ms / 2, y, str(e["microbatch"]), ha="center",
                        va="center", fontsize=7, color="white", clip_on=True)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time since step start (ms)")
    stats = bubble(events, ideal)
    theory = (f"{stats['bubble_theoretical']:.1%} theory {stats['theory']}" if ideal
              else stats["theory"])
    ax.set_title(f"{title}\nidle per device {stats['bubble_measured']:.1%} measured (mean of "
                 f"{stats['devices']} devices) vs {theory}", fontsize=10)
    phases = [p for p in PHASE_COLORS if p in set(events["phase"].astype(str))]
    handles: list[Patch] = [Patch(color=PHASE_COLORS[p]) for p in phases]
    names = [PHASE_NAMES[p] for p in phases]
    if two_stages:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//"))
        names.append("device's 2nd stage")
    ax.legend(handles, names, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              frameon=False)
    return stats
