"""Where the ideal speedup goes: each case's measured step cut into the waterfall's parts.

One panel per workload; per case a horizontal bar of seconds, from the ideal (single's step
over the devices: an N-fold speedup) through the step's parts in ``analysis.step_parts.PARTS``
order (the device's smaller batch, its optimizer step, devices computing together, the
busiest device's extra work, the schedule's bubble, the communication not hidden, the
strategy's own work) to what no part explains (the remainder, hatched; where the parts
overstate the step it is drawn back from their end). The bar ends at the measured step; the
label gives the speedup measured against the ideal one. ``bench_lib.rows.waterfall``
states each part. A run folder from before a part's column draws it as 0 (its remainder
holds it). Reads cases.csv only; never imports torch.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from bench_lib.analysis.step_parts import PARTS as STEP_PARTS
from bench_lib.analysis.step_parts import WORDS
from bench_lib.report.figure_kit import (
    WORKLOAD,
    facets,
    labelled_ok_cases,
    records,
    styled,
    workload_title,
)
from bench_lib.results.read import number

COLOURS = {"ideal": "#4c72b0", "batch": "#dd8452", "optimizer": "#8172b3",
           "corun": "#da8bc3", "imbalance": "#937860", "bubble": "#c44e52",
           "comm": "#55a868", "own": "#ccb974"}
"""Each step part's colour (a KeyError here: a part added to ``step_parts`` needs one)."""
PARTS = tuple((p, WORDS[p], COLOURS[p]) for p in STEP_PARTS)
"""(part, legend words, colour) in the step's order."""
REMAINDER = ("remainder", "unexplained (remainder)", "#bbbbbb")
PANEL = [*WORKLOAD, "scaling"]
"""A panel per workload and scaling (a weak case's batch is its devices' together)."""


@styled
def fig_waterfall(cases: pd.DataFrame) -> Figure | None:
    """The waterfall of every case that has one, per workload (module docstring)."""
    df = labelled_ok_cases(cases, "waterfall_ideal_s", workload=False)
    if df.empty:
        return None
    if "scaling" not in df:  # a run before weak scaling: every case strong
        df = df.assign(scaling="strong")
    keys: list[tuple[Any, ...]] = sorted(set(df[PANEL].itertuples(index=False, name=None)),
                                         key=lambda k: (k[:4], k[4] == "weak"))
    fig, axes = facets(len(keys), width=7.0, height=0.9 + 0.42 * df.label.nunique(),
                       max_cols=2)
    for ax, key in zip(axes, keys):
        mine = df[(df[PANEL] == pd.Series(key, index=PANEL)).all(axis=1)]
        for y, r in enumerate(records(mine)):
            left = 0.0
            for part, _, color in PARTS:
                # A column an older run lacks (or a mixed run's NaN): 0, in its remainder.
                width = max(number(r.get(f"waterfall_{part}_s")) or 0.0, 0.0)
                ax.barh(y, width, left=left, color=color, height=0.6)
                left += width
            rest = float(r["waterfall_remainder_s"])
            start, width = (left, rest) if rest >= 0 else (left + rest, -rest)
            ax.barh(y, width, left=start, color=REMAINDER[2], height=0.6, hatch="///",
                    edgecolor="#666666", linewidth=0.5)
            measured = float(r["step_time_s_median"])
            n = int(r["world_size"])
            # single's step over the measured one: ideal / measured x N
            speedup = float(r["waterfall_ideal_pct"]) / 100 * n
            ax.text(max(left, measured) * 1.02, y,
                    f"{speedup:.2f}x of single (ideal {n}x); unexplained "
                    f"{float(r['waterfall_remainder_pct']):+.0f}%",
                    va="center", fontsize=7)
        ax.set_yticks(range(len(mine)), mine.label.tolist())
        ax.invert_yaxis()
        ax.set_xlabel("seconds per step (the bar ends at the measured median)")
        weak = (f" · weak: {int(mine.batch_size.iloc[0] // mine.world_size.iloc[0])} per "
                "device" if key[4] == "weak" else "")
        ax.set_title(workload_title(key[:4]) + weak, fontsize=10)
        ax.set_xlim(0, float(mine.step_time_s_median.max()) * 1.7)
    handles = [Patch(color=c, label=text) for _, text, c in PARTS]
    handles.append(Patch(facecolor=REMAINDER[2], hatch="///", edgecolor="#666666",
                         label=REMAINDER[1]))
    fig.legend(handles=handles, loc="upper center", ncol=3, fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.965))
    fig.suptitle("Where the ideal speedup goes: each case's step from the ideal (single's over "
                 "N devices) to the measured one, part by part", fontsize=10, y=0.995)
    return fig
