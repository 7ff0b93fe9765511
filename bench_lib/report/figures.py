"""Figures of one or more runs, drawn from their files only: throughput, split trade-off,
winner grid, scaling.

Every function takes the cases of all compared runs as one DataFrame (cases.csv rows with
``run_label`` and ``case_key`` added by ``runs.load_runs``) and returns a
``matplotlib.figure.Figure``, or None when the runs hold nothing to draw. A case that did
not run (``skipped``, ``unsupported``, ``oom``, ``timeout``, ``error``) is drawn as a hatched
bar labelled with its status, never left out. The parts they are drawn with, and the style
they are drawn under, are ``figure_kit``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from bench_lib.report.figure_kit import (
    WORKLOAD,
    best_row,
    by_workload,
    facets,
    grouped_bars,
    records,
    representatives,
    strategy_color,
    styled,
    workload_title,
)
from bench_lib.report.ranking import rank
from bench_lib.report.row_values import case_name, speedup_interval


@styled
def fig_throughput(cases: pd.DataFrame) -> Figure | None:
    """1. Throughput per strategy (median, 95% CI error bars), step time over each bar."""
    reps = representatives(cases)
    reps = reps.assign(tp_lo=reps.batch_size / reps.step_time_s_ci_high,
                       tp_hi=reps.batch_size / reps.step_time_s_ci_low)
    groups = by_workload(reps)
    fig, axes = facets(len(groups))
    for ax, (key, g) in zip(axes, groups, strict=True):
        grouped_bars(ax, g, "throughput_img_s", ("tp_lo", "tp_hi"),
                     lambda r: f"{r.step_time_s_median:.3g} s")
        ax.set_title(workload_title(key), fontsize=10)
        ax.set_ylabel("throughput (images/s)")
    fig.suptitle("Throughput per strategy (error bars: 95% CI across launches; label: median "
                 "step time; pipelined: best split)", fontsize=11)
    _legend_runs(axes, cases)
    return fig


def _legend_runs(axes: list[Axes], cases: pd.DataFrame) -> None:
    if cases.run_label.nunique() > 1:
        axes[0].legend(fontsize=8, title="run", loc="upper left")


def unmeasured_candidates(cases: pd.DataFrame) -> pd.Series:
    """Which rows are a split search's unmeasured candidates: skipped with a predicted step
    (``sweep.splits``; no other skipped case is predicted)."""
    predicted = (cases.step_time_s_predicted.notna() if "step_time_s_predicted" in cases
                 else pd.Series(False, index=cases.index))
    return (cases.status == "skipped") & predicted


def _predicted_line(ax: Axes, line: pd.DataFrame, strat: str,
                    color: tuple[float, float, float]) -> bool:
    """The predicted step of every split of ``line`` (one strategy, one run) as a thin
    dashed line; False where fewer than two splits are predicted."""
    if "step_time_s_predicted" not in line:
        return False
    pred = line[line.step_time_s_predicted.notna()].sort_values("split_size")
    if len(pred) < 2:
        return False
    ax.plot(pred.split_size, pred.step_time_s_predicted, linestyle=(0, (4, 3)), marker=".",
            markersize=5, linewidth=1.1, alpha=0.6, color=color, label=f"_predicted {strat}")
    return True


@styled
def fig_split_tradeoff(cases: pd.DataFrame) -> Figure | None:
    """2. Step time against split size per pipelined strategy, the optimum starred; where
    splits were predicted, the predicted curve through every candidate beside them."""
    split = cases[cases.split_size.notna()]
    if split.empty:
        return None
    groups = by_workload(split)
    fig, axes = facets(len(groups))
    styles = ["-", "--", ":", "-."]
    predicted_any = False
    for ax, (key, g) in zip(axes, groups, strict=True):
        for (run, name), line in g.groupby(["run_label", "strategy"]):
            strat = str(name)
            color = strategy_color(strat)
            predicted_any |= _predicted_line(ax, line, strat, color)
            line = line[~unmeasured_candidates(line)]  # on the predicted line, not crossed
            ok = line[line.status == "ok"].sort_values("split_size")
            ls = styles[sorted(cases.run_label.unique()).index(run) % 4]
            label = strat + (f" ({run})" if cases.run_label.nunique() > 1 else "")
            ax.errorbar(ok.split_size, ok.step_time_s_median, capsize=3, marker="o",
                        yerr=[ok.step_time_s_median - ok.step_time_s_ci_low,
                              ok.step_time_s_ci_high - ok.step_time_s_median],
                        color=color, linestyle=ls, label=label)
            if not ok.empty:
                best = best_row(ok, "step_time_s_median", lowest=True)
                ax.plot(best.split_size, best.step_time_s_median, marker="*", markersize=16,
                        color=color, markeredgecolor="black", zorder=5)
                ax.annotate(f"best {int(best.split_size)}", (best.split_size,
                            best.step_time_s_median), textcoords="offset points",
                            xytext=(0, -16), ha="center", fontsize=8)
            for r in records(line[line.status != "ok"]):
                ax.plot(r["split_size"], 0.04, marker="x", color="red", markersize=9,
                        transform=ax.get_xaxis_transform(), clip_on=False)
                ax.annotate(r["status"], (r["split_size"], 0.04),
                            xycoords=ax.get_xaxis_transform(),
                            xytext=(4, 2), textcoords="offset points", fontsize=7, color="red")
        single = cases[(cases.strategy == "single") & (cases.status == "ok")]
        base = single.set_index(WORKLOAD).step_time_s_median
        if key in base.index:
            ax.axhline(np.min(base.loc[[key]]), color="grey", linestyle="--", label="single")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("split size (images per micro-batch)")
        ax.set_ylabel("median step time (s)")
        ax.set_title(workload_title(key), fontsize=10)
        ax.legend(fontsize=8)
    # Wrapped: one facet is about 90 characters wide at this size.
    caption = ("\ndashed line: predicted for every split; points: measured\n(the predicted "
               "best and its neighbours)" if predicted_any else "")
    fig.suptitle("Split-size trade-off: lower is better\n(★ optimum, ✕ case that did not run)"
                 + caption, fontsize=10)
    return fig


def _grid_cells(g: pd.DataFrame, col: str) -> pd.DataFrame:
    """Per (image size, column value), the fastest ok case where that value applies, with
    ``grid_verdict`` against the cell's runner-up (``ranking.rank``: winner, tie, no
    interval, alone), ``grid_runner_up`` and the speedup's 95% interval ``grid_ci``
    (``row_values.speedup_interval``: None with 1 launch)."""
    ok = g[g.status == "ok"]
    cells: list[dict[str, Any]] = []
    for image in sorted(g.image_size.unique()):
        for value in sorted(g[col].dropna().unique()):
            cand = records(ok[(ok.image_size == image) & ((ok[col] == value) | ok[col].isna())])
            found = rank(cand)
            if found is None:
                continue
            cells.append(dict(found.best) | {
                "grid_row": image, "grid_col": value, "grid_verdict": found.verdict,
                "grid_runner_up": None if found.runner_up is None else case_name(found.runner_up),
                "grid_ci": speedup_interval(found.best)})
    return pd.DataFrame(cells)


def _cell_text(cell: Mapping[str, Any]) -> str:
    """A grid cell's words: the winner, or ``tie: a`` over ``~ b``; the speedup over single
    with its 95% interval (none with 1 launch); ``(no interval)`` where no winner can be
    claimed."""
    speed, ci = cell["speedup_vs_single"], cell["grid_ci"]
    sp = "no single" if pd.isna(speed) else f"{speed:.2f}x" + (
        f"\n[{ci[0]:.2f}, {ci[1]:.2f}]" if isinstance(ci, tuple) else "")
    name = case_name(cell)
    if cell["grid_verdict"] == "tie":
        return f"tie: {name}\n~ {cell['grid_runner_up']}\n{sp}"
    if cell["grid_verdict"] == "no interval":
        return f"{name}\n{sp}\n(no interval)"
    return f"{name}\n{sp}"


@styled
def fig_winner_grid(cases: pd.DataFrame) -> Figure | None:
    """3. Image size x split size (or batch size): the winning strategy and its speedup."""
    col = "split_size" if cases.split_size.notna().any() else "batch_size"
    keys = ["run_label", "model", "precision"] + (["batch_size"] if col == "split_size" else [])
    names = ["", "", "", "batch "]
    panels = [(k, _grid_cells(g, col)) for k, g in sorted(cases.groupby(keys))]
    panels = [(k, c) for k, c in panels if not c.empty]
    if not panels:
        return None
    fig, axes = facets(len(panels), width=6.0, height=3.6, max_cols=2)
    for ax, (key, cells) in zip(axes, panels, strict=True):
        rows, cols = sorted(cells.grid_row.unique()), sorted(cells.grid_col.unique())
        speed = np.full((len(rows), len(cols)), np.nan)
        for c in records(cells):
            speed[rows.index(c["grid_row"]), cols.index(c["grid_col"])] = c["speedup_vs_single"]
        finite = speed[np.isfinite(speed)]
        span = max(1.05, *(abs(np.log2(finite)) if finite.size else [0]))
        norm = TwoSlopeNorm(vcenter=1.0, vmin=2 ** -span, vmax=2 ** span)
        im = ax.imshow(np.nan_to_num(speed, nan=1.0), cmap="RdYlGn", norm=norm, aspect="auto")
        for c in records(cells):
            r, k = rows.index(c["grid_row"]), cols.index(c["grid_col"])
            ax.text(k, r, _cell_text(c), ha="center", va="center", fontsize=8,
                    fontstyle="italic" if c["grid_verdict"] == "tie" else "normal")
        _mark_best_split(ax, cases, key, keys, rows, cols, col)
        ax.set_xticks(range(len(cols)), [str(int(v)) for v in cols])
        ax.set_yticks(range(len(rows)), [f"{int(v)} px" for v in rows])
        ax.set_xlabel("split size (images per micro-batch)" if col == "split_size"
                      else "batch size (images)")
        ax.set_ylabel("image size")
        ax.set_title(" · ".join(f"{n}{v}" for n, v in zip(names, key, strict=False)), fontsize=10)
        ax.grid(False)
        ax.set_xticks(np.arange(len(cols) + 1) - 0.5, minor=True)
        ax.set_yticks(np.arange(len(rows) + 1) - 0.5, minor=True)
        ax.grid(which="minor", color="white", linewidth=4, alpha=1)
        ax.tick_params(which="minor", length=0)
        fig.colorbar(im, ax=ax, label="speedup over single (x)")
    fig.suptitle("Winning strategy per cell, its speedup over single [95% CI]\n"
                 "tie: runner-up over best step time, paired by round, CI holds 1\n"
                 "(a case with 1 launch: their own 95% CIs overlap)\n"
                 "black box: best split of a pipelined strategy per image size", fontsize=10)
    fig.subplots_adjust(top=1 - 1.25 / fig.get_figheight())  # room for the four lines
    return fig


def _mark_best_split(ax: Axes, cases: pd.DataFrame, key: tuple[Any, ...], keys: list[str],
                     rows: list[Any], cols: list[Any], col: str) -> None:
    """A black box on the best split of a pipelined strategy, per image size."""
    if col != "split_size":
        return
    g = cases[(cases[keys] == pd.Series(key, index=keys)).all(axis=1)]
    piped = g[(g.status == "ok") & g.split_size.notna()]
    for image, sel in piped.groupby("image_size"):
        best = best_row(sel, "throughput_img_s")
        if image in rows and best.split_size in cols:
            x, y = cols.index(best.split_size), rows.index(image)
            ax.add_patch(Rectangle((x - 0.42, y - 0.42), 0.84, 0.84, fill=False,
                                   edgecolor="black", linewidth=2))
            # At the box's foot, clear of the cell's words (four lines for a tie).
            ax.text(x, y + 0.4, f"best {best.strategy} split", ha="center", va="bottom",
                    fontsize=7)


@styled
def fig_scaling(cases: pd.DataFrame, weak: pd.DataFrame | None = None) -> Figure | None:
    """7. Scaling efficiency: speedup over single divided by the devices used; a panel per
    workload under strong scaling, and one per workload's per-device batch under weak
    (``weak``: the weak-scaling cases, whose speedup is a throughput ratio)."""
    reps = representatives(cases)
    panels = [(workload_title(key), g) for key, g in by_workload(reps[reps.strategy != "single"])]
    if weak is not None and not weak.empty:
        panels = [(f"{title} · strong", g) for title, g in panels]
        w = representatives(weak)
        w = w.assign(per_device=(w.batch_size // w.world_size).astype(int))
        for (model, image, per, precision), g in sorted(
                w.groupby(["model", "image_size", "per_device", "precision"])):
            panels.append((f"{model} · {image} px · {per} per device · {precision} · weak", g))
    if not panels:
        return None
    fig, axes = facets(len(panels))
    for ax, (title, g) in zip(axes, panels, strict=True):
        # The speedup's 95% interval over the devices (NaN with 1 launch: no error bar).
        g = g.assign(eff_lo=g.speedup_ci_low / g.world_size,
                     eff_hi=g.speedup_ci_high / g.world_size)
        grouped_bars(ax, g, "scaling_efficiency", ("eff_lo", "eff_hi"),
                     lambda r: f"{r.speedup_vs_single:.2f}x on {int(r.world_size)}")
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
        ax.text(ax.get_xlim()[1], 1.0, " ideal", va="center", fontsize=8)
        ax.set_ylabel("scaling efficiency (speedup / devices)")
        ax.set_title(title, fontsize=10)
    weak_words = ("\nweak: each device keeps single's batch; the speedup is the throughput "
                  "over single's" if weak is not None and not weak.empty else "")
    fig.suptitle("Scaling efficiency per strategy (label: speedup over single on N devices)"
                 f"{weak_words}\nerror bars: the speedup's 95% CI (paired by round) over N",
                 fontsize=11)
    _legend_runs(axes, pd.concat([cases, weak]) if weak is not None else cases)
    return fig
