"""The parts every report figure is drawn with: the look (``STYLE``, ``styled``), a colour
and an order per strategy, the workload's key and title, a figure's panels (``new_figure``,
``facets``), bars per strategy with failures hatched (``grouped_bars``), the
predicted-against-measured axes, and the small reads of a cases DataFrame they share
(``representatives``, ``labelled_ok_cases``, ``records``, ``best_row``).

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
from matplotlib.colors import TABLEAU_COLORS, to_rgb
from matplotlib.figure import Figure

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
