"""The report of a distance run folder (``python -m bench_lib distance``): its table and one
figure (step time and peak memory per device against the kernel count, per method), from
distance.csv only.

Like the rest of ``bench_lib.report`` it never imports torch (nor ``bench_lib.distance``).
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from bench_lib.report.figure_kit import PALETTE, new_figure, records, styled
from bench_lib.report.html import CSS, cell_number, cell_text
from bench_lib.results.read import read_table
from bench_lib.results.schema import DISTANCE_COLUMNS, ResultsError

DISTANCE_FILE = "distance.csv"
FIGURE_FILE = "fig_distance.png"
METHOD_LOOK: dict[str, dict[str, Any]] = {
    "loop": {"color": PALETTE[3], "marker": "s"},
    "blocked": {"color": PALETTE[0], "marker": "o"},
    "split": {"color": PALETTE[2], "marker": "D"},
}


def is_distance_run(run_dir: Path) -> bool:
    """True for a folder that ``distance`` wrote (distance.csv, and no sweep's cases.csv)."""
    return (run_dir / DISTANCE_FILE).is_file() and not (run_dir / "cases.csv").exists()


def read_distance(run_dir: Path) -> pd.DataFrame:
    """distance.csv, checked for its columns (ResultsError: unusable or empty)."""
    df = read_table(run_dir / DISTANCE_FILE, DISTANCE_COLUMNS)
    if df.empty:
        raise ResultsError(f"{run_dir} holds no distance case yet: nothing to report")
    return df


def _look(method: str) -> dict[str, Any]:
    return METHOD_LOOK.get(method, {"color": "#555555", "marker": "x"})


def _panel(ax: Axes, df: pd.DataFrame, col: str, low: str | None, high: str | None) -> None:
    """``col`` against the kernel count per method (log-log), with its interval where the
    rows have one; a case that did not end ok is an open marker on the axis' floor."""
    for method, g in df.groupby("method", sort=False):
        ok = g[(g.status == "ok") & g[col].notna()].sort_values("kernels")
        look = _look(str(method))
        if not ok.empty:
            y = ok[col].to_numpy(dtype=float)
            err = None
            if low and high and ok[low].notna().all() and ok[high].notna().all():
                err = np.vstack([y - ok[low].to_numpy(dtype=float),
                                 ok[high].to_numpy(dtype=float) - y])
            ax.errorbar(ok.kernels, y, yerr=err, lw=1.4, ms=5, capsize=3, label=str(method),
                        **look)
        failed = g[g.status.isin(["oom", "error", "timeout"])]
        for r in records(failed):
            ax.annotate(f"{method} {r['status']}", (r["kernels"], 0), xycoords=("data",
                        "axes fraction"), xytext=(0, 6), textcoords="offset points",
                        ha="center", fontsize=8, color=look["color"])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("kernels (output channels)")


@styled
def fig_distance(df: pd.DataFrame) -> Figure | None:
    """Step time (with its interval across launches) and the largest per-device peak memory
    net of the runtime, against the kernel count, one line per method."""
    if not (df.status == "ok").any():
        return None
    fig, axes = new_figure(1, 2, (12, 4.4))
    _panel(axes[0, 0], df, "step_time_s_median", "step_time_s_ci_low", "step_time_s_ci_high")
    axes[0, 0].set_ylabel("step: forward + backward, s")
    _panel(axes[0, 1], df, "peak_mem_net_mib_max", None, None)
    axes[0, 1].set_ylabel("peak memory per device, net of the runtime, MiB")
    caps = df.max_memory_per_device_mib.dropna()
    if not caps.empty:
        axes[0, 1].axhline(float(caps.iloc[0]), color="#aa3333", ls="--", lw=1,
                           label="memory cap per device")
    for ax in axes[0]:
        ax.legend(fontsize=8)
    fig.suptitle("Pairwise distance of a conv weight's kernels: a Python loop, blocked "
                 "cdist on one device, split over the devices")
    return fig


def _table(df: pd.DataFrame) -> str:
    """One row per case: status, step time and interval, speedup, memory, agreement."""
    head = ("layer", "kernels", "method", "devices", "status", "step s", "95% interval",
            "vs blocked", "peak MiB per device", "value rel diff", "grad rel diff", "agrees",
            "reason")
    body = []
    for r in records(df):
        interval = (f"{cell_number(r['step_time_s_ci_low'], '.4g')} – "
                    f"{cell_number(r['step_time_s_ci_high'], '.4g')}"
                    if pd.notna(r["step_time_s_ci_low"]) else "")
        speedup = cell_number(r["speedup_vs_blocked"], ".2f")
        if speedup and pd.notna(r["speedup_ci_low"]):
            speedup += (f" [{cell_number(r['speedup_ci_low'], '.2f')}, "
                        f"{cell_number(r['speedup_ci_high'], '.2f')}]")
        agrees = "" if pd.isna(r["agrees"]) else ("yes" if r["agrees"] else "NO")
        nums = [cell_number(r["kernels"], ".0f")]
        cells = [f"<td>{cell_text(r['layer'])}</td>", *(f"<td class=num>{n}</td>" for n in nums),
                 f"<td>{cell_text(r['method'])}</td>",
                 f"<td class=num>{cell_number(r['world_size'], '.0f')}</td>",
                 f"<td><span class=status>{cell_text(r['status'])}</span></td>"]
        nums = [cell_number(r["step_time_s_median"], ".4g"), interval, speedup]
        cells += [f"<td class=num>{n}</td>" for n in nums]
        cells.append(f"<td>{cell_text(r['peak_mem_net_mib_by_device'])}</td>")
        nums = [cell_number(r["value_rel_diff"], ".1e"), cell_number(r["grad_rel_diff"], ".1e"),
                agrees]
        cells += [f"<td class=num>{n}</td>" for n in nums]
        cells.append(f"<td>{cell_text(r['reason'])}</td>")
        bad = r["status"] != "ok" and r["status"] not in ("skipped", "unsupported")
        body.append(f"<tr{' class=notok' if bad or agrees == 'NO' else ''}>{''.join(cells)}"
                    "</tr>")
    heads = "".join(f"<th>{h}</th>" for h in head)
    return f"<table><tr>{heads}</tr>{''.join(body)}</table>"


HOW = (
    "<p>D = &sum;<sub>p,q</sub> &Vert;X<sub>p</sub> &minus; X<sub>q</sub>&Vert; over every "
    "ordered pair of kernels (rows of the weight reshaped to out &times; in&middot;kh&middot;kw; "
    "both orders, the diagonal 0), kept differentiable. One step is its forward and backward "
    "(on ranks, the gradient's all-reduce too). <b>loop</b> is the question's double Python "
    "loop; <b>blocked</b> runs <code>torch.cdist</code> on blocks of rows on one device, "
    "whose autograd keeps every block's distances for the backward, n&sup2; numbers; "
    "<b>split</b> spreads the rows over the rig's devices, dividing that. Step times are the "
    "geometric mean of each launch's median with a t interval across launches; speedups are "
    "over blocked, paired by round. Values and gradients are compared with a float64 "
    "reference in closed form; <i>agrees</i> is within the row's agree_rtol.</p>")


def render(df: pd.DataFrame, name: str, captions: list[str], png_b64: str | None) -> str:
    """The whole page of a distance run folder."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    figure = (f"<figure><img src=\"data:image/png;base64,{png_b64}\" alt=\"step time and "
              f"memory per method\"><figcaption>{FIGURE_FILE}</figcaption></figure>" if png_b64
              else "<p class=missing>No case ended ok: nothing to draw.</p>")
    body = [f"<h1>parabench distance report</h1><p class=sub>{cell_text(name)} · written {now}</p>",
            "<p class=caption>" + "<br>".join(cell_text(c) for c in captions) + "</p>", HOW,
            "<h2 id=figure>Step time and memory</h2>", figure,
            "<h2 id=cases>Cases</h2>", _table(df)]
    return ("<!DOCTYPE html><html lang=en><head><meta charset=utf-8><link rel=icon "
            "href=\"data:,\"><meta name=viewport content=\"width=device-width, "
            f"initial-scale=1\"><title>parabench distance: {cell_text(name)}</title><style>{CSS}"
            f"</style></head><body>{''.join(body)}</body></html>\n")
