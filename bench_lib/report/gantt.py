"""The pipeline timeline read back from timeline.csv: idle (bubble) fraction and Gantt chart.

The worker records the rows (``bench_lib.measure.trace``); this half only reads them. Each
(rank, stage) row is idle whenever it runs neither a forward nor a backward; the mean idle
fraction is set beside the schedule's theoretical bubble (S-1)/(M+S-1)::

    stage 0 |F0|F1|F2|F3|          |B3|B2|B1|B0|
    stage 1    |F0|F1|F2|F3|B3|B2|B1|B0|
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from matplotlib.axes import Axes
from matplotlib.patches import Patch

PHASE_COLORS = {"fwd": "#4C72B0", "bwd": "#DD8452"}


def theoretical_bubble(stages: int, microbatches: int) -> float:
    """GPipe's idle fraction (S-1)/(M+S-1) for S stages and M micro-batches."""
    return (stages - 1) / (microbatches + stages - 1)


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals, overlaps counted once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def bubble(events: pd.DataFrame) -> dict[str, Any]:
    """Measured idle fraction of one case's traced step beside the theoretical one.

    Each (rank, stage) row is idle whenever it runs neither a forward nor a backward within
    the step's span (first start to last end over all rows); the figure is their mean.
    """
    lo, hi = events["start_s"].min(), events["end_s"].max()
    rows = events.groupby(["rank", "stage"])
    idle = [1 - _union_length(list(zip(g.start_s, g.end_s, strict=True))) / (hi - lo)
            for _, g in rows]
    stages, microbatches = rows.ngroups, int(events["microbatch"].max()) + 1
    return {"stages": stages, "microbatches": microbatches, "span_s": hi - lo,
            "bubble_measured": sum(idle) / len(idle),
            "bubble_theoretical": theoretical_bubble(stages, microbatches)}


def draw_gantt(ax: Axes, events: pd.DataFrame, title: str) -> dict[str, Any]:
    """One Gantt row per (rank, stage): forward and backward bars labelled by micro-batch."""
    keys = sorted({(r, s) for r, s in zip(events["rank"], events["stage"], strict=True)})
    t0 = events["start_s"].min()
    span_ms = (events["end_s"].max() - t0) * 1e3
    for y, (rank, stage) in enumerate(keys):
        rows = events[(events["rank"] == rank) & (events["stage"] == stage)]
        for r in rows.itertuples():
            width_ms = (r.end_s - r.start_s) * 1e3
            ax.barh(y, width_ms, left=(r.start_s - t0) * 1e3, height=0.7,
                    color=PHASE_COLORS[str(r.phase)], edgecolor="white", linewidth=0.6)
            if width_ms > 0.015 * span_ms:  # a label wider than its bar is noise
                ax.text((r.start_s - t0) * 1e3 + width_ms / 2, y, str(r.microbatch),
                        ha="center", va="center", fontsize=7, color="white", clip_on=True)
    labels = [f"stage {s}\n{events.loc[events['stage'] == s, 'device'].iloc[0]}"
              + (f" r{r}" if events["rank"].nunique() > 1 else "") for r, s in keys]
    ax.set_yticks(range(len(keys)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("time since step start (ms)")
    stats = bubble(events)
    ax.set_title(f"{title}\nidle {stats['bubble_measured']:.0%} measured vs "
                 f"{stats['bubble_theoretical']:.0%} theoretical "
                 f"(S={stats['stages']}, M={stats['microbatches']})", fontsize=10)
    handles = [Patch(color=c) for c in PHASE_COLORS.values()]
    ax.legend(handles, ["forward", "backward"], loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize=8, frameon=False)
    return stats
