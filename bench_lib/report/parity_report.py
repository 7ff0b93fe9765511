"""The report of a parity run folder (``python -m bench_lib parity``): the learning curves of
every strategy and the verdict table, from parity.csv and parity_verdicts.csv only.

Like the rest of ``bench_lib.report`` it never imports torch (nor ``bench_lib.parity``,
which does): the tolerances' derivation is told here in words, and each row carries its
own numbers (``tolerance_note``).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from bench_lib.report.figure_kit import (
    ORDER,
    new_figure,
    records,
    strategy_color,
    strategy_order,
    styled,
)
from bench_lib.report.html import CSS, cell_number, cell_text
from bench_lib.results.read import read_table
from bench_lib.results.schema import PARITY_COLUMNS, PARITY_VERDICT_COLUMNS, ResultsError

PARITY_FILE, VERDICTS_FILE = "parity.csv", "parity_verdicts.csv"
FIGURE_FILE = "fig_parity.png"
PANELS = (("train_loss", "training loss"), ("test_loss", "test loss"),
          ("test_accuracy", "test accuracy"))
DIFF_FLOOR = 1e-9
"""Where the difference panel draws a difference too small for its log scale (0 included)."""
FAILED = ("diverged", "error")
MARKERS = "osD^vPX*<>"


@dataclass(frozen=True)
class ParityRun:
    """A parity run folder's two tables."""

    epochs: pd.DataFrame
    """parity.csv: every epoch of every training run."""
    verdicts: pd.DataFrame
    """parity_verdicts.csv: one row per model and strategy."""


def is_parity_run(run_dir: Path) -> bool:
    """True for a folder that ``parity`` wrote (parity.csv, and no sweep's cases.csv)."""
    return (run_dir / PARITY_FILE).is_file() and not (run_dir / "cases.csv").exists()


def read_parity(run_dir: Path) -> ParityRun:
    """Both tables, checked for their columns (ResultsError: unusable)."""
    epochs = read_table(run_dir / PARITY_FILE, PARITY_COLUMNS)
    if not (run_dir / VERDICTS_FILE).is_file():
        raise ResultsError(f"{run_dir} has {PARITY_FILE} but no {VERDICTS_FILE}: the parity "
                           "run did not finish")
    verdicts = read_table(run_dir / VERDICTS_FILE, PARITY_VERDICT_COLUMNS)
    if epochs.empty and verdicts.empty:
        raise ResultsError(f"{run_dir} holds no parity result: nothing to report")
    return ParityRun(epochs, verdicts)


def _main_seed(m: pd.DataFrame) -> Any:
    """The run's own seed among a model's runs: its fp64 reference's (every strategy trains
    at it; only single's further seed runs differ), else the least."""
    fp64 = m.loc[m.precision == "fp64", "seed"]
    return fp64.iloc[0] if not fp64.empty else m.seed.min()


def _main_runs(epochs: pd.DataFrame, model: str) -> pd.DataFrame:
    """A model's float32 runs at the run's own seed."""
    m = epochs[epochs.model == model]
    main: pd.DataFrame = m[(m.precision == "fp32") & (m.seed == _main_seed(m))]
    return main


def _curves(ax: Axes, epochs: pd.DataFrame, model: str, col: str,
            verdicts: dict[str, str]) -> None:
    """One panel: each strategy's curve, single's fp64 dashed, its other seeds grey."""
    m = epochs[epochs.model == model]
    main, own = _main_runs(epochs, model), _main_seed(m)
    for seed, g in m[(m.strategy == "single") & (m.precision == "fp32")].groupby("seed"):
        if seed != own:
            ax.plot(g.epoch, g[col], color="#bbbbbb", lw=1, label="single, other seeds")
    fp64 = m[m.precision == "fp64"]
    for name in strategy_order(main.strategy):
        g = main[main.strategy == name]
        bad = verdicts.get(name) in FAILED
        ax.plot(g.epoch, g[col], lw=2.4 if bad else 1.4, **_look(name),
                label=name + (f" ({verdicts[name]})" if bad else ""))
    if not fp64.empty:
        ax.plot(fp64.epoch, fp64[col], color="black", lw=1, ls="--", label="single fp64")


def _differences(ax: Axes, epochs: pd.DataFrame, model: str, verdicts: pd.DataFrame) -> None:
    """|test loss - compared_with's| per epoch (log scale), with the tolerances."""
    main = _main_runs(epochs, model).set_index(["strategy", "epoch"]).test_loss
    judged = verdicts[(verdicts.model == model) & verdicts.compared_with.notna()]
    for r in records(judged):
        if r["strategy"] not in main.index or r["compared_with"] not in main.index:
            continue
        diff = (main[r["strategy"]] - main[r["compared_with"]]).abs().dropna()
        ax.plot(diff.index, np.maximum(diff.to_numpy(), DIFF_FLOOR), lw=1.4,
                **_look(r["strategy"]), label=r["strategy"])
    for kind, ls in (("rounding", ":"), ("seeds", "--")):
        tol = judged.loc[judged.tolerance_kind == kind, "loss_tolerance"].dropna()
        if not tol.empty:
            ax.axhline(float(tol.iloc[0]), color="#555555", ls=ls, lw=1,
                       label=f"{kind} tolerance")
    ax.set_yscale("log")
    ax.set_title(f"{model}: |test loss − compared_with|", fontsize=10)
    ax.set_ylabel(f"0 (identical) drawn at {DIFF_FLOOR:g}", fontsize=8, color="#777777")


@styled
def fig_parity(run: ParityRun) -> Figure | None:
    """Per model (rows): training loss, test loss, test accuracy per epoch per strategy,
    and each strategy's distance to what it is judged against, with the tolerances."""
    models = list(dict.fromkeys(run.epochs.model))
    if not models:
        return None
    # Four panels and the row's legend (in a fifth, narrow one, so nothing covers a curve).
    fig, axes = new_figure(len(models), 5, (19, 3.4 * len(models) + 0.8),
                           gridspec_kw={"width_ratios": [1, 1, 1, 1, 0.42]})
    verdict_of = {(r["model"], r["strategy"]): str(r["verdict"]) for r in records(run.verdicts)}
    for row, model in zip(axes, models):
        mine = {s: v for (m, s), v in verdict_of.items() if m == model}
        for ax in row[:4]:
            ax.set_xlabel("epoch")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        for ax, (col, title) in zip(row, PANELS):
            ax.set_title(f"{model}: {title}", fontsize=10)
            if run.epochs.loc[run.epochs.model == model, col].isna().all():
                ax.text(0.5, 0.5, "no accuracy: a regression", ha="center", va="center",
                        transform=ax.transAxes, color="#777777")
                ax.set_xticks([])
                ax.set_yticks([])
                continue
            _curves(ax, run.epochs, model, col, mine)
            if col != "test_accuracy":  # losses fall by decades: the ends stay apart
                ax.set_yscale("log")
        _differences(row[3], run.epochs, model, run.verdicts)
        _legend(row[4], row[:4])
    fig.suptitle("Learning parity: every strategy from the same weights on the same batches "
                 "(hollow markers: curves that coincide stay visible)")
    return fig


def _look(name: str) -> dict[str, Any]:
    """A strategy's colour and hollow marker, the same in every panel."""
    known = ORDER.index(name) if name in ORDER else len(ORDER) + sum(map(ord, name))
    return {"color": strategy_color(name), "marker": MARKERS[known % len(MARKERS)],
            "ms": 5, "mfc": "none"}


def _legend(slot: Axes, panels: Sequence[Axes]) -> None:
    """The panels' lines, each label once, in ``slot`` (an axes with nothing else)."""
    handles: dict[str, Any] = {}
    for ax in panels:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    slot.axis("off")
    slot.legend(list(handles.values()), list(handles), loc="center left", fontsize=8,
                frameon=False)


def _verdict_table(verdicts: pd.DataFrame) -> str:
    """Every model's strategies with their verdict, figures and tolerance."""
    head = ("model", "strategy", "BatchNorm statistics", "verdict", "final test loss",
            "accuracy", "compared with", "loss diff", "loss tolerance", "accuracy diff",
            "accuracy tolerance", "tolerance", "reason")
    body = []
    for r in records(verdicts):
        cells = [cell_text(r["model"]), cell_text(r["strategy"]),
                 cell_text(r["bn_statistics"]) or "none",
                 f"<span class=status>{cell_text(r['verdict'])}</span>"]
        nums = [cell_number(r["test_loss"], ".5f"), cell_number(r["test_accuracy"], ".4f")]
        cells += [f"<td class=num>{n}</td>" for n in nums]
        cells.append(cell_text(r["compared_with"]))
        nums = [cell_number(r[c], ".2e") for c in ("test_loss_diff", "loss_tolerance")]
        nums += [cell_number(r[c], ".4f") for c in ("test_accuracy_diff", "accuracy_tolerance")]
        cells += [f"<td class=num>{n}</td>" for n in nums]
        cells += [cell_text(r["tolerance_kind"]), cell_text(r["reason"])]
        html = "".join(c if c.startswith("<td") else f"<td>{c}</td>" for c in cells)
        cls = " class=notok" if r["verdict"] in FAILED else ""
        body.append(f"<tr{cls}>{html}</tr>")
    heads = "".join(f"<th>{h}</th>" for h in head)
    notes = verdicts.dropna(subset=["tolerance_note"]).drop_duplicates(
        ["model", "tolerance_kind"])
    items = "".join(f"<li><b>{cell_text(n['model'])}</b>, {cell_text(n['tolerance_kind'])}: "
                    f"{cell_text(n['tolerance_note'])}</li>" for n in records(notes))
    return (f"<table><tr>{heads}</tr>{''.join(body)}</table>"
            f"<h3>The tolerances of this run</h3><ul>{items}</ul>")


HOW = (
    "<p>A BatchNorm-free model (mlp, toy) computes the same mathematics under every "
    "strategy; only the order of float32 sums differs. single also trains in float64: a "
    "strategy matches when its final test loss is within 10x the largest float32-to-float64 "
    "distance of single over the epochs (the <i>rounding</i> tolerance), and its accuracy "
    "within 10x the images that distance flipped (at least one). A BatchNorm model (a "
    "ResNet) normalises over what one forward sees: the whole batch (single, mp, ddp/fsdp "
    "with SyncBatchNorm), each micro-batch (accum, pipeline, gpipe, 1f1b) or each rank's "
    "share (ddp, fsdp). accum and ddp are judged against single with the <i>seeds</i> "
    "tolerance: single trains at further seeds, and a strategy matches when it ends within "
    "the 99% prediction bound of one more seed, the larger of t x &radic;2 x the seeds' "
    "standard deviation and z x &radic;2 x the test set's standard error. Strategies with "
    "the same statistics compute the same mathematics: each is judged against the first of "
    "its kind (single, accum, ddp) with the tighter of the two tolerances, since rounding "
    "differences that training amplifies end, at worst, as far apart as two seeds. A "
    "strategy that diverged, or failed, makes <code>parity</code> exit 1.</p>")


def _matched_html(verdicts: pd.DataFrame) -> str:
    """One line: how many strategies matched, and which did not."""
    judged = verdicts[verdicts.verdict.isin(["match", *FAILED])]
    bad = [f"{r['model']} {r['strategy']} ({r['verdict']})" for r in records(judged)
           if r["verdict"] in FAILED]
    text = f"{(judged.verdict == 'match').sum()} of {len(judged)} judged strategies match"
    return f"<p class=best>{cell_text(text)}{'; ' + cell_text(', '.join(bad)) if bad else '.'}</p>"


def render(run: ParityRun, name: str, captions: list[str], png_b64: str | None) -> str:
    """The whole page of a parity run folder."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    figure = (f"<figure><img src=\"data:image/png;base64,{png_b64}\" alt=\"learning curves "
              f"per strategy\"><figcaption>{FIGURE_FILE}</figcaption></figure>" if png_b64
              else "<p class=missing>No epoch finished: no curve to draw.</p>")
    body = [f"<h1>parabench parity report</h1><p class=sub>{cell_text(name)} · written {now}</p>",
            "<p class=caption>" + "<br>".join(cell_text(c) for c in captions) + "</p>",
            "<h2>Verdict</h2>", _matched_html(run.verdicts), HOW,
            "<h2 id=curves>Learning curves</h2>", figure,
            "<h2 id=verdicts>Verdict per strategy</h2>", _verdict_table(run.verdicts)]
    return ("<!DOCTYPE html><html lang=en><head><meta charset=utf-8><link rel=icon "
            "href=\"data:,\"><meta name=viewport content=\"width=device-width, "
            f"initial-scale=1\"><title>parabench parity: {cell_text(name)}</title><style>{CSS}"
            f"</style></head><body>{''.join(body)}</body></html>\n")
