"""Figures about devices: peak memory per device, samples over time, the pipeline timeline.

Like ``figures``: ``Figure`` objects drawn under ``figure_kit.STYLE``, nothing changed in
matplotlib at import; data from the run folders' files only (cases, samples.csv, timeline.csv).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from bench_lib.report.figure_kit import (
    FAILED_STYLE,
    PALETTE,
    WORKLOAD,
    bar_label,
    by_workload,
    facets,
    new_figure,
    records,
    representatives,
    strategy_order,
    styled,
    workload_title,
)
from bench_lib.report.gantt import bubble, case_theory, draw_gantt

# samples.csv columns in order of preference: GPUs' own counters first (GPM SM activity,
# then NVML's kernel-active time: analysis.utilisation), then the CPU rig's.
TIME_COLUMNS = ("t_s", "time_s", "elapsed_s", "time_unix_s")
UTIL_COLUMNS = ("sm_util_pct", "util_gpu_pct", "cpu_pct")
AXIS_LABELS = {"sm_util_pct": "GPM SM activity (%)", "util_gpu_pct": "kernel-active, NVML (%)",
               "cpu_pct": "worker CPU (%)", "mem_used_mib": "GPU memory used (MiB)",
               "rss_mib": "resident memory (MiB)"}
MEM_COLUMNS = ("mem_used_mib", "rss_mib")
MAX_CASES = 4
DEVICE_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3"]


def parse_by_device(text: object) -> dict[str, float]:
    """``"0:812.5;1:655.0"`` -> ``{"0": 812.5, "1": 655.0}`` (empty for a missing value)."""
    if not isinstance(text, str) or not text:
        return {}
    return {k: float(v) for k, v in (item.rsplit(":", 1) for item in text.split(";"))}


@styled
def fig_memory(cases: pd.DataFrame) -> Figure | None:
    """4. Peak memory per device for each strategy (device imbalance shows as uneven bars):
    what the case adds, after warm-up and net of each process's runtime (the net columns)."""
    reps = representatives(cases)
    groups = by_workload(reps)
    if not groups:
        return None
    most = max(len(g) for _, g in groups)
    fig, axes = facets(len(groups), width=max(5.2, 0.75 * most + 1.5))
    for ax, (key, g) in zip(axes, groups, strict=True):
        labels, peaks = [], g.loc[g.status == "ok", "peak_mem_net_mib_max"]
        fail_h = 0.25 * peaks.max() if peaks.notna().any() else 1.0
        ordered = g.sort_values(["strategy", "run_label"], key=_order)
        for x, (_, row) in enumerate(ordered.iterrows()):
            mem = parse_by_device(row.peak_mem_net_mib_by_device)
            label = bar_label(row) + (f"\n{row.run_label}" if g.run_label.nunique() > 1 else "")
            if len(mem) > 1 and min(mem.values()) > 0:
                label += f"\n{max(mem.values()) / min(mem.values()):.2f}x"  # max over min
            labels.append(label)
            if row.status != "ok" or not mem:
                ax.bar(x, fail_h, 0.8, **FAILED_STYLE)
                ax.text(x, fail_h, row.status, rotation=90, ha="center", va="bottom",
                        fontsize=8, color="#555555")
                continue
            width = 0.8 / len(mem)
            for i, (dev, mib) in enumerate(sorted(mem.items())):
                bx = x + (i - (len(mem) - 1) / 2) * width
                ax.bar(bx, mib, width * 0.92, color=_device_color(dev), edgecolor="black",
                       linewidth=0.5, label=f"device {dev}")
                ax.text(bx, mib, f"{mib:.0f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylabel("peak memory per device, net of the runtime (MiB)")
        ax.set_title(workload_title(key), fontsize=10)
        handles = dict(zip(*reversed(ax.get_legend_handles_labels()), strict=True))
        ax.legend(handles.values(), handles.keys(), fontsize=8, loc="upper left",
                  bbox_to_anchor=(1.0, 1.0), frameon=False)
    what = ("CPU rig: each worker process's peak resident memory minus its footprint before "
            "the model was built" if cases.rig.astype(str).str.startswith("cpu").all()
            else "CUDA allocator peak")
    fig.suptitle(f"Peak memory per device after warm-up, net of the runtime ({what})\n"
                 "device '0+1': one process drives both; under a label, max over min across "
                 "its devices", fontsize=11)
    return fig


def _device_color(dev: str) -> str:
    """Device 0, 1, ... get fixed colours; a process driving several ('0+1') gets grey."""
    return DEVICE_COLORS[int(dev) % len(DEVICE_COLORS)] if dev.isdigit() else "#9a9a9a"


def _order(col: pd.Series) -> pd.Series:
    """A sort key: strategies in ``strategy_order``, any other column as it is."""
    if col.name != "strategy":
        return col
    order = strategy_order(col)
    return col.map(order.index)


def _pick(cases: pd.DataFrame, have: set[str]) -> pd.DataFrame:
    """The cases to draw over time: per strategy, the fastest at the largest image size."""
    ok = cases[(cases.status == "ok") & cases.case_key.isin(have)]
    ok = ok[ok.image_size == ok.image_size.max()]
    best = representatives(ok)
    best = best.sort_values("strategy", key=_order)
    return best.head(MAX_CASES)


def _first(df: pd.DataFrame, names: Iterable[str]) -> str | None:
    """The first of ``names`` that ``df`` has with any value."""
    return next((c for c in names if c in df.columns and df[c].notna().any()), None)


@styled
def fig_samples(cases: pd.DataFrame, samples: pd.DataFrame | None) -> Figure | None:
    """5. Utilisation and memory over time per device, for one case per strategy."""
    if samples is None or samples.empty:
        return None
    t_col, u_col, m_col = (_first(samples, c) for c in (TIME_COLUMNS, UTIL_COLUMNS, MEM_COLUMNS))
    if t_col is None or (u_col is None and m_col is None):
        return None
    chosen = _pick(cases, set(samples.case_key))
    if chosen.empty:
        return None
    metrics = [c for c in (u_col, m_col) if c is not None]
    fig, axes = new_figure(len(metrics), len(chosen),
                           (4.6 * len(chosen), 2.9 * len(metrics) + 0.9), sharex="col")
    for j, case in enumerate(records(chosen)):
        s, launches = first_launch(samples[samples.case_key == case["case_key"]], t_col)
        t = s[t_col] - s[t_col].min()
        for i, metric in enumerate(metrics):
            ax = axes[i][j]
            for k, (dev, d) in enumerate(s.assign(_t=t).groupby("device")):
                d = d[d[metric].notna()]
                if not d.empty:
                    ax.plot(d._t, d[metric], color=PALETTE[k % 10], label=f"device {dev}")
            ax.set_ylabel(AXIS_LABELS.get(metric, metric))
            if i == 0:
                weak = " (weak)" if case.get("scaling") == "weak" else ""
                of = f" · launch 1 of {launches}" if launches > 1 else ""
                ax.set_title(f"{bar_label(case)}{weak} · {case['image_size']} px{of}",
                             fontsize=10)
            ax.legend(fontsize=7)
        axes[-1][j].set_xlabel("time since the launch started (s)")
    fig.suptitle("Utilisation and memory over time per device (a case's first launch: build, "
                 "warm-up, timed steps)", fontsize=11)
    return fig


LAUNCH_GAP_S = 2.0
"""A pause in a case's samples longer than this, and than 10 of its sampler's ticks, is
between two of its launches: the sampler ticks every 0.1 s by default
(``--sample-interval-ms``) while a launch runs, and other cases' launches run between a
case's own (rounds)."""


def first_launch(samples: pd.DataFrame, t_col: str) -> tuple[pd.DataFrame, int]:
    """A case's samples of its first launch, and how many launches its samples hold: drawn
    whole, a line would run across the other cases' launches between its own."""
    if samples.empty:
        return samples, 0
    ordered = samples.sort_values(t_col, kind="stable")
    steps = ordered[t_col].diff()
    tick = steps[steps > 0].median() if (steps > 0).any() else 0.0
    launch = (steps > max(LAUNCH_GAP_S, 10 * tick)).cumsum()
    return ordered[launch == 0], int(launch.iloc[-1]) + 1


@styled
def fig_timeline(cases: pd.DataFrame, timeline: pd.DataFrame | None) -> Figure | None:
    """6. Measured pipeline timeline: a Gantt chart per pipelined case, one row per device,
    its bubble measured per device beside the schedule's theory."""
    if timeline is None or timeline.empty:
        return None
    chosen = _pick(cases, set(timeline.case_key))
    if chosen.empty:
        return None
    rows = [timeline[timeline.case_key == c] for c in chosen.case_key]
    heights = [1.2 + 0.5 * r.groupby(["rank", "device"]).ngroups for r in rows]
    fig, axes = new_figure(len(rows), 1, (11, sum(heights) + 0.9), height_ratios=heights)
    for ax, case, events in zip(axes[:, 0], records(chosen), rows, strict=True):
        workload = workload_title(tuple(case[k] for k in WORKLOAD))
        title = f"{bar_label(case)} · {workload}"
        draw_gantt(ax, events, title, case_theory(case))
    fig.suptitle("Measured pipeline timeline of one traced step (after the timed steps), one "
                 "row per device; numbers are micro-batches", fontsize=11)
    return fig


def bubble_table(cases: pd.DataFrame, timeline: pd.DataFrame | None) -> pd.DataFrame:
    """Measured (mean over devices) and theoretical idle share of every case that has a
    timeline."""
    if timeline is None or timeline.empty:
        return pd.DataFrame()
    rows: list[dict[str, Any]] = []
    for key, events in timeline.groupby("case_key"):
        case = cases[cases.case_key == key].iloc[0]
        rows.append({"run": case.run_label, "case_id": case.case_id,
                     "strategy": case.strategy, "split_size": case.split_size,
                     # The traced step beside the median step (empty in older rows).
                     "traced_step_s": case.get("traced_step_s"),
                     "traced_vs_median_pct": case.get("traced_vs_median_pct")}
                    | bubble(events, case_theory(case)))
    return pd.DataFrame(rows)
