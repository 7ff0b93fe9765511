"""Figures of one or more runs, drawn from their files only: throughput, split trade-off,
winner grid, scaling.

Every function takes the cases of all compared runs as one DataFrame (cases.csv rows with
``run_label`` and ``case_key`` added by ``runs.load_runs``) and returns a
``matplotlib.figure.Figure``, or None when the runs hold nothing to draw. A case that did
not run (``skipped``, ``unsupported``, ``oom``, ``timeout``, ``error``) is drawn as a hatched
bar labelled with its status, never left out.

Importing this module changes nothing in matplotlib: no backend is chosen and no global
``rcParams`` are set. Figures are ``Figure`` objects, not pyplot's (``fig.savefig`` writes
them whatever the backend, and a notebook keeps its own), drawn under ``STYLE`` in an
``rc_context`` (``styled``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, ParamSpec

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.colors import TABLEAU_COLORS, TwoSlopeNorm, to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from bench_lib.report.headlines import case_name, rank, speedup_interval

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

WORKLOAD = ["model", "image_size", "batch_size", "precision"]
GROUP = ["run_label", *WORKLOAD]
ORDER = ["single", "dp", "ddp", "fsdp", "accum", "mp", "pipeline", "gpipe", "1f1b",
         "interleaved-1f1b"]
PALETTE = tuple(to_rgb(c) for c in TABLEAU_COLORS.values())  # tab10
FAILED_STYLE: dict[str, Any] = {"facecolor": "#f2f2f2", "edgecolor": "#888888", "hatch": "///",
                                "linewidth": 0.8}
STYLE: dict[RcKeyType, Any] = {"figure.dpi": 110, "axes.spines.top": False,
                               "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3,
                               "axes.axisbelow": True}
"""The report's look, applied only while a figure is drawn or written (``styled``)."""

P = ParamSpec("P")


def styled(draw: Callable[P, Figure | None]) -> Callable[P, Figure | None]:
    """``draw`` run under ``STYLE`` (an ``rc_context``): the caller's rcParams stay as they are."""

    @functools.wraps(draw)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> Figure | None:
        with matplotlib.rc_context(STYLE):
            return draw(*args, **kwargs)

    return wrapper


def strategy_color(name: str) -> tuple[float, float, float]:
    """The same colour for a strategy in every figure."""
    known = ORDER.index(name) if name in ORDER else len(ORDER) + sum(map(ord, name))
    return PALETTE[known % len(PALETTE)]


def strategy_order(names: Iterable[str]) -> list[str]:
    """Known strategies in a fixed order, then any others alphabetically."""
    present = set(names)
    return [s for s in ORDER if s in present] + sorted(present - set(ORDER))


def labelled_ok_cases(cases: pd.DataFrame, column: str, workload: bool = True) -> pd.DataFrame:
    """The ok cases with ``column`` set, in strategy order (then image size, batch, split),
    each with a short ``label``: the run where several are drawn, the strategy, its image
    size and batch (``workload``; leave them out where each workload has a panel of its own)
    and its split."""
    if column not in cases:
        return cases.iloc[0:0]
    df = cases[(cases.status == "ok") & cases[column].notna()].copy()
    if df.empty:
        return df
    order = {s: i for i, s in enumerate(strategy_order(df.strategy.unique()))}
    df["_order"] = df.strategy.map(order)
    df = df.sort_values(["_order", "image_size", "batch_size", "split_size"], kind="stable")
    many = "run_label" in df and df.run_label.nunique() > 1

    def label(r: pd.Series) -> str:
        split = f" s{int(r.split_size)}" if pd.notna(r.split_size) and r.split_size != "" else ""
        run = f"{r.run_label} " if many else ""
        size = f" {r.image_size}px b{r.batch_size}" if workload else ""
        return f"{run}{r.strategy}{size}{split}"

    df["label"] = df.apply(label, axis=1)
    return df.drop(columns="_order").reset_index(drop=True)


def workload_title(key: tuple[Any, ...]) -> str:
    """``resnet50 · 128 px · batch 32 · fp32`` from a (model, image, batch, precision) key."""
    model, image, batch, precision = key
    return f"{model} · {image} px · batch {batch} · {precision}"


def representatives(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, workload, strategy): the fastest ok case, else the first failure."""
    df = df.assign(_ok=df.status == "ok", _tp=df.throughput_img_s.fillna(-1.0))
    df = df.sort_values(["_ok", "_tp"], ascending=False, kind="stable")
    return df.drop_duplicates([*GROUP, "strategy"]).drop(columns=["_ok", "_tp"])


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """The rows as column -> value dicts, in order."""
    return [{str(k): v for k, v in row.items()} for row in df.to_dict("records")]


def best_row(df: pd.DataFrame, col: str, *, lowest: bool = False) -> pd.Series:
    """The first row with the largest (``lowest``: smallest) ``col``; missing values skipped."""
    return df.iloc[int(df[col].argmin() if lowest else df[col].argmax())]


def bar_label(row: pd.Series | Mapping[str, Any]) -> str:
    """The strategy, plus its split when it has one (``pipeline s8``)."""
    split = row["split_size"]
    return str(row["strategy"]) + (f" s{int(split)}" if pd.notna(split) and split != "" else "")


def new_figure(rows: int, cols: int, figsize: tuple[float, float],
               **subplots: Any) -> tuple[Figure, np.ndarray]:
    """A Figure of rows x cols axes (a 2-D array), made without pyplot or its backend."""
    fig = Figure(figsize=figsize)
    axes = fig.subplots(rows, cols, squeeze=False, **subplots)
    return fig, axes


def predicted_vs_measured_axes(ax: Axes, lo: float, hi: float,
                                bands: Iterable[tuple[float, str, str]]) -> None:
    """Log-log axes from ``lo`` to ``hi`` for predicted (y) against measured (x): each band
    (relative half-width, colour, label; widest first) around the equality line, the line
    itself, and plain tick labels (200, not 2x10^2)."""
    from matplotlib.ticker import FuncFormatter

    x = np.geomspace(lo, hi, 50)
    for width, color, label in bands:
        ax.fill_between(x, x * (1 - width), x * (1 + width), color=color, label=label)
    ax.plot(x, x, color="#777777", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(plain)
        axis.set_minor_formatter(plain)
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)


def facets(n: int, width: float = 5.2, height: float = 3.8,
           max_cols: int = 3) -> tuple[Figure, list[Axes]]:
    """A Figure with ``n`` panels in rows of at most ``max_cols``."""
    cols = min(n, max_cols)
    rows = -(-n // cols)
    fig, axes = new_figure(rows, cols, (width * cols, height * rows + 0.9))
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def _failed_bar(ax: Axes, x: float, width: float, height: float, status: str) -> None:
    ax.bar(x, height, width, **FAILED_STYLE)
    ax.text(x, height, status, ha="center", va="bottom", fontsize=8, color="#555555",
            rotation=90)


def grouped_bars(ax: Axes, reps: pd.DataFrame, value: str, err: tuple[str, str] | None,
                 fmt: Callable[[Any], str]) -> None:
    """Bars per strategy (x), one per run within a group; failures hatched."""
    runs = sorted(reps.run_label.unique())
    strategies = strategy_order(reps.strategy)
    width = 0.8 / len(runs)
    top = reps.loc[reps.status == "ok", value].max()
    fail_h = 0.25 * top if pd.notna(top) and top > 0 else 1.0
    labelled = set()  # the first drawn bar of each run carries its legend entry
    for i, run in enumerate(runs):
        for j, strat in enumerate(strategies):
            sel = reps[(reps.run_label == run) & (reps.strategy == strat)]
            if sel.empty:
                continue
            row, x = sel.iloc[0], j + (i - (len(runs) - 1) / 2) * width
            if row.status != "ok" or pd.isna(row[value]):
                _failed_bar(ax, x, width * 0.9, fail_h,
                            row.status if row.status != "ok" else "no baseline")
                continue
            yerr = None
            if err is not None and pd.notna(row[err[0]]):
                yerr = [[row[value] - row[err[0]]], [row[err[1]] - row[value]]]
            ax.bar(x, row[value], width * 0.9, yerr=yerr, capsize=3,
                   color=strategy_color(strat), alpha=1.0 - 0.35 * i, edgecolor="black",
                   linewidth=0.5, label=None if run in labelled else run)
            labelled.add(run)
            # Inside the bar, at its foot: clear of the error bars above it.
            ax.text(x, 0, fmt(row), ha="center", va="bottom", fontsize=7,
                    rotation=90 if len(runs) > 1 else 0,
                    bbox={"facecolor": "white", "alpha": 0.75, "pad": 1, "linewidth": 0})
    labels = [bar_label(reps[reps.strategy == s].iloc[0]) for s in strategies]
    ax.set_xticks(range(len(strategies)), labels, rotation=20, ha="right")


def by_workload(df: pd.DataFrame) -> list[tuple[tuple[Any, ...], pd.DataFrame]]:
    """(workload key, its rows) per workload, in key order."""
    return sorted(df.groupby(WORKLOAD), key=lambda kv: kv[0])


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
    ``grid_verdict`` against the cell's runner-up (``headlines.rank``: winner, tie, no
    interval, alone), ``grid_runner_up`` and the speedup's 95% interval ``grid_ci``
    (``headlines.speedup_interval``: None with 1 launch)."""
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
