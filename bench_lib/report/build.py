"""The report: PNG figures and one self-contained report.html from one or more run folders.

    python -m bench_lib report RUN_DIR [RUN_DIR ...]

Reads only files (env.json, cases.csv, steps.csv, and samples.csv / timeline.csv where
present); it never imports torch, the runner, or touches a device. Everything is read and
checked before anything is written, so an unusable folder writes nothing. Several runs are
drawn side by side; the report goes into the first run's folder.

No matplotlib backend is chosen, here or anywhere in ``bench_lib.report``: the figures are
``Figure`` objects written as PNG with ``fig.savefig``, so a notebook that imports this keeps
its backend and its rcParams.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.figure import Figure

from bench_lib.report import (
    bound_figure,
    curve_figure,
    device_figures,
    distance_report,
    figure_kit,
    figures,
    memory_prediction,
    parity_report,
    time_prediction,
    waterfall_figure,
)
from bench_lib.report.html import render
from bench_lib.report.runs import Runs, caption, load_runs
from bench_lib.results.read import read_env
from bench_lib.results.schema import ResultsError

REPORT_NAME = "report.html"


# (number, file stem, title, what it needs when absent)
FIGURES: list[tuple[int, str, str, str]] = [
    (1, "throughput", "Throughput and step time per strategy", "no case"),
    (2, "split_tradeoff", "Split-size trade-off", "no pipelined case with a split size"),
    (3, "winner_grid", "Winning strategy per image size and split", "no case ran"),
    (4, "memory", "Peak memory per device", "no case"),
    (5, "samples", "Utilisation and memory over time",
     "not measured in this run (no samples.csv with utilisation or memory columns)"),
    (6, "timeline", "Measured pipeline timeline",
     "not measured in this run (no timeline.csv: no pipelined case ran)"),
    (7, "scaling", "Scaling efficiency, strong and weak", "no case besides single"),
    (8, "memory_prediction", "Predicted against measured peak memory",
     "no ok case with both a predicted and a measured peak per device"),
    # The step time each case's own measured parts allow (bench_lib/analysis/bound.py), beside
    # the measured one; for pipelines, the bound's parts and the gap over it.
    (9, "bound", "Measured step time against the bound of its own parts",
     "no ok case with a bound (step_time_s_bound: pipelines, mp, ddp, fsdp)"),
    (10, "batch_curve", "single's batch curve: per-image speed against images per device",
     "no batch curve in these runs (the profile's batch_curve is off)"),
    (11, "waterfall", "Where the ideal speedup goes, part by part",
     "no ok case with a waterfall (it needs single's batch curve: the profile's batch_curve)"),
    (12, "time_prediction", "Step time predicted before launch against measured",
     "no ok case with a predicted step time (the profile's predict_time is off)"),
]


def draw_figures(runs: Runs) -> dict[int, Figure]:
    """Every figure the runs hold data for, by number (absent: nothing to draw). The
    figures that compare strategies within a workload (1-3) take the strong-scaling cases;
    those of each case on its own (memory, timeline, bound, waterfall) the weak ones too,
    in panels or labels of their own batch; 7 sets both side by side."""
    c, swept = runs.cases, runs.swept
    figs = {1: figures.fig_throughput(c), 2: figures.fig_split_tradeoff(c),
            3: figures.fig_winner_grid(c), 4: device_figures.fig_memory(swept),
            5: device_figures.fig_samples(swept, runs.samples),
            6: device_figures.fig_timeline(swept, runs.timeline),
            7: figures.fig_scaling(c, runs.weak),
            8: memory_prediction.fig_prediction(swept), 9: bound_figure.fig_bound(swept),
            10: curve_figure.fig_batch_curve(runs.curve, c),
            11: waterfall_figure.fig_waterfall(swept),
            12: time_prediction.fig_time_prediction(swept)}
    return {n: f for n, f in figs.items() if f is not None}


def _png(fig: Figure, captions: list[str]) -> bytes:
    """The figure as PNG bytes, with the runs' rig and versions written under it.

    Laid out and written under the figures' style (``rc_context``): nothing global changes.
    """
    with matplotlib.rc_context(figure_kit.STYLE):
        fig.text(0.01, 0.005, "\n".join(captions), fontsize=7, color="#444444", va="bottom",
                 ha="left", wrap=True)
        fig.tight_layout(rect=(0, 0.03 + 0.025 * len(captions), 1, 0.95))
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def write_parity_report(run_dir: Path) -> Path:
    """A parity run folder's report.html and learning-curve PNG (``parity_report``)."""
    run = parity_report.read_parity(run_dir)
    name = run_dir.resolve().name
    captions = [caption(name, read_env(run_dir))]
    fig = parity_report.fig_parity(run)
    png = _png(fig, captions) if fig is not None else None
    html = parity_report.render(run, name, captions,
                                base64.b64encode(png).decode() if png else None)
    if png:
        (run_dir / parity_report.FIGURE_FILE).write_bytes(png)
    path = run_dir / REPORT_NAME
    path.write_text(html, encoding="utf-8")
    return path


def write_distance_report(run_dir: Path) -> Path:
    """A distance run folder's report.html and its PNG (``distance_report``)."""
    df = distance_report.read_distance(run_dir)
    name = run_dir.resolve().name
    captions = [caption(name, read_env(run_dir))]
    fig = distance_report.fig_distance(df)
    png = _png(fig, captions) if fig is not None else None
    html = distance_report.render(df, name, captions,
                                  base64.b64encode(png).decode() if png else None)
    if png:
        (run_dir / distance_report.FIGURE_FILE).write_bytes(png)
    path = run_dir / REPORT_NAME
    path.write_text(html, encoding="utf-8")
    return path


def write_report(run_dirs: list[Path]) -> Path:
    """Write the PNGs and report.html into the first run folder; returns the HTML's path.

    A parity run folder (``python -m bench_lib parity``) gets its own page, alone."""
    if any(parity_report.is_parity_run(d) for d in run_dirs):
        if len(run_dirs) > 1:
            raise ResultsError("a parity run folder is reported on its own: give only it")
        return write_parity_report(run_dirs[0])
    if any(distance_report.is_distance_run(d) for d in run_dirs):  # its own page too
        if len(run_dirs) > 1:
            raise ResultsError("a distance run folder is reported on its own: give only it")
        return write_distance_report(run_dirs[0])
    runs = load_runs(run_dirs)
    captions = [caption(label, env, runs.names[label]) for label, env in runs.envs.items()]
    pngs = {n: _png(f, captions) for n, f in draw_figures(runs).items()}
    sections: list[dict[str, Any]] = []
    for number, stem, title, absent in FIGURES:
        data = pngs.get(number)
        sections.append({"number": number, "title": title, "file": f"fig{number}_{stem}.png",
                         "png_b64": base64.b64encode(data).decode() if data else None,
                         "absent": absent})
    html = render(runs, sections, captions,
                  device_figures.bubble_table(runs.swept, runs.timeline))
    out = run_dirs[0]
    for s in sections:
        if s["png_b64"]:
            (out / s["file"]).write_bytes(pngs[s["number"]])
    path = out / REPORT_NAME
    path.write_text(html, encoding="utf-8")
    return path
