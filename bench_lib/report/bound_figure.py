"""Measured step time against the bound of the case's own parts, and where the gap goes.

The bound (``step_time_s_bound``, ``bench_lib.analysis.bound``) is the step time the case's
measured pieces allow: a pipeline's schedule run with its traced pass times and the measured
p2p time; ddp/fsdp the local batch's compute overlapped with the gradient collectives at the
run's measured bandwidth. Top: every case with a bound, measured beside bound, labelled with
``efficiency_vs_bound_pct``. Bottom: each pipelined case's bound cut into its parts (compute
of the busiest device, the schedule's bubble, p2p, the rest of the step) beside the measured
step, whose excess over the bound is what the implementation loses (scheduling, waits,
passes slower inside the pipeline than traced). Reads cases.csv only; never imports torch.
"""

from __future__ import annotations

import html
import math

import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from bench_lib.report.figure_kit import (
    labelled_ok_cases,
    new_figure,
    strategy_color,
    strategy_order,
    styled,
)

PARTS = (("bound_compute_s", "compute (busiest device)", "#4c72b0"),
         ("bound_bubble_s", "bubble", "#dd8452"),
         ("bound_comm_s", "p2p / transfers", "#55a868"),
         ("bound_other_s", "rest of step (optimizer...)", "#8172b2"))
GAP_COLOR = "#c44e52"
EXPLAIN = ("bound = what the case's own measured parts allow (bench_lib/analysis/bound.py); "
           "efficiency = bound / measured")


def bound_cases(cases: pd.DataFrame) -> pd.DataFrame:
    """The ok cases with a bound, in strategy order, each with a short ``label``."""
    return labelled_ok_cases(cases, "step_time_s_bound")


def _measured_vs_bound(ax: Axes, df: pd.DataFrame) -> None:
    measured = df.step_time_s_median.astype(float).tolist()
    bounds = df.step_time_s_bound.astype(float).tolist()
    shares = df.efficiency_vs_bound_pct.astype(float).tolist()
    for i, (name, m, b, pct) in enumerate(zip(df.strategy, measured, bounds, shares)):
        color = strategy_color(str(name))
        ax.bar(i - 0.2, m, 0.4, color=color, edgecolor="black", linewidth=0.4)
        ax.bar(i + 0.2, b, 0.4, color=color, alpha=0.35, hatch="//", edgecolor="black",
               linewidth=0.4)
        ax.text(i, max(m, b) * 1.02, f"{pct:.0f}%", ha="center", va="bottom", fontsize=7)
    handles: list[Artist] = [Patch(facecolor="#999999", edgecolor="black", label="measured median"),
                             Patch(facecolor="white", edgecolor="black", hatch="//",
                                   label="bound")]
    if "step_time_s_bound_no_overlap" in df:
        flat = df[df.step_time_s_bound_no_overlap.notna()]
        if not flat.empty:
            handles.append(ax.scatter([i + 0.2 for i in flat.index],
                                      flat.step_time_s_bound_no_overlap, marker="_", s=160,
                                      color="black", zorder=3,
                                      label="bound without overlap (ddp/fsdp)"))
    _case_ticks(ax, df)
    ax.set_ylabel("step time (s)")
    ax.set_title("Measured step against its bound; label: efficiency vs bound", fontsize=10)
    ax.legend(handles=handles, fontsize=7, loc="upper left")
    ax.set_ylim(0, 1.3 * max(measured + bounds))  # room for the legend and the labels


def _case_ticks(ax: Axes, df: pd.DataFrame) -> None:
    """One tick per case, slanted: strategy names are long."""
    ax.set_xticks(list(range(len(df))), list(df.label), fontsize=7, rotation=30, ha="right",
                  rotation_mode="anchor")


def _pipeline_gap(ax: Axes, df: pd.DataFrame) -> None:
    x = list(range(len(df)))
    bottom = [0.0] * len(df)
    for column, name, color in PARTS:
        values = [float(v) if pd.notna(v) else 0.0 for v in df[column]]
        ax.bar([i - 0.2 for i in x], values, 0.4, bottom=bottom, color=color,
               edgecolor="black", linewidth=0.3, label=f"bound: {name}")
        bottom = [b + v for b, v in zip(bottom, values)]
    gap = [max(0.0, m - b) for m, b in zip(df.step_time_s_median, df.step_time_s_bound)]
    ax.bar([i + 0.2 for i in x], list(df.step_time_s_bound), 0.4, color="#bbbbbb",
           edgecolor="black", linewidth=0.3, label="measured: up to the bound")
    ax.bar([i + 0.2 for i in x], gap, 0.4, bottom=list(df.step_time_s_bound), color=GAP_COLOR,
           edgecolor="black", linewidth=0.3, label="measured: gap over the bound")
    _case_ticks(ax, df)
    ax.set_ylabel("step time (s)")
    ax.set_title("Pipelined cases: the bound's parts (left bar) against the measured step "
                 "(right bar)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    ax.set_ylim(0, 1.35 * max(max(bottom), float(df.step_time_s_median.max())))


@styled
def fig_bound(cases: pd.DataFrame) -> Figure | None:
    """Measured against bound per case, and the pipelined cases' gap decomposed; None
    where no ok case has a bound."""
    df = bound_cases(cases)
    if df.empty:
        return None
    piped = df[df.bound_bubble_s.notna() & df.step_time_s_bound_no_overlap.isna()] \
        if "bound_bubble_s" in df and "step_time_s_bound_no_overlap" in df else df.iloc[0:0]
    rows = 2 if not piped.empty else 1
    fig, axes = new_figure(rows, 1, (max(7.0, 0.6 * len(df) + 2), 4.0 * rows + 0.4))
    _measured_vs_bound(axes[0][0], df)
    if rows == 2:
        _pipeline_gap(axes[1][0], piped.reset_index(drop=True))
    fig.suptitle(EXPLAIN, fontsize=8)
    return fig


def efficiency_table(cases: pd.DataFrame) -> pd.DataFrame:
    """Per strategy: cases with a bound, the median, lowest and highest efficiency vs bound
    (%), and the median speedup over single, measured and as the bound allows (single's
    step over the bound: the speedup at 100% efficiency; NaN without a speedup)."""
    df = bound_cases(cases)
    if df.empty:
        return pd.DataFrame()
    speedup = (df.speedup_vs_single.astype(float) if "speedup_vs_single" in df
               else pd.Series(float("nan"), index=df.index))
    df = df.assign(speedup=speedup, allowed=speedup * 100 / df.efficiency_vs_bound_pct)
    g = df.groupby("strategy")
    table = pd.DataFrame({"cases": g.size(), "median_pct": g.efficiency_vs_bound_pct.median(),
                          "low_pct": g.efficiency_vs_bound_pct.min(),
                          "high_pct": g.efficiency_vs_bound_pct.max(),
                          "speedup": g.speedup.median(), "allowed_speedup": g.allowed.median()})
    return table.loc[strategy_order(table.index)].reset_index()


def _x(value: object) -> str:
    """``1.48x``, or nothing for a missing speedup."""
    return f"{value:.2f}x" if isinstance(value, float) and not math.isnan(value) else ""


def explain_html(cases: pd.DataFrame) -> str:
    """The sentence and the per-strategy efficiency table under the figure (empty where no
    case has a bound)."""
    table = efficiency_table(cases)
    if table.empty:
        return ""
    body = "".join(
        f"<tr><td>{html.escape(str(r.strategy))}</td><td class=num>{r.cases}</td>"
        f"<td class=num>{r.median_pct:.0f}%</td><td class=num>{r.low_pct:.0f}-"
        f"{r.high_pct:.0f}%</td><td class=num>{_x(r.speedup)}</td>"
        f"<td class=num>{_x(r.allowed_speedup)}</td></tr>" for r in table.itertuples())
    return ("<table><tr><th>strategy</th><th>cases</th><th>median efficiency vs bound</th>"
            "<th>range</th><th>speedup vs single</th><th>speedup the bound allows</th></tr>"
            f"{body}</table><p class=caption>The bound is the step time "
            "the case's own measured parts allow: a pipeline's schedule replayed with the "
            "passes of its traced step and the measured p2p time; mp every pass in turn; "
            "ddp and fsdp the local share of single's step overlapped with the gradient "
            "collectives at the bandwidth measured at the start of the run (env.json "
            "collectives). Efficiency is bound over measured: the rest is what the "
            "implementation loses (bench_lib/analysis/bound.py states every formula). Medians "
            "over each strategy's cases.</p>")
