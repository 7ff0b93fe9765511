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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import pandas as pd
from matplotlib.figure import Figure

from bench_lib.report import (
    bound_figure,
    curve_figure,
    device_figures,
    figures,
    parity_report,
    prediction,
    time_prediction,
    waterfall_figure,
)
from bench_lib.report.html import render
from bench_lib.results.read import read_cases, read_env, read_table
from bench_lib.results.schema import TIMELINE_COLUMNS, ResultsError

REPORT_NAME = "report.html"


@dataclass
class Runs:
    """Every compared run's files, concatenated; ``case_key`` is ``<run label>/<case id>``."""

    envs: dict[str, dict[str, Any]]
    """Run label -> env.json. One run: its folder's name; several: A, B, ... (see names)."""
    names: dict[str, str]
    """Run label -> run folder name."""
    cases: pd.DataFrame
    """The sweep's strong-scaling cases (the batch curve's rows and the weak-scaling cases
    apart, in ``curve`` and ``weak``)."""
    samples: pd.DataFrame | None
    timeline: pd.DataFrame | None
    curve: pd.DataFrame
    """single's batch-curve rows (``batch_curve_of`` set): a figure of their own."""
    weak: pd.DataFrame
    """The weak-scaling cases (``scaling`` weak): compared with single at their per-device
    batch, in the scaling figure and the headlines."""

    @property
    def swept(self) -> pd.DataFrame:
        """The sweep's cases, strong and weak (the batch curve left out)."""
        return pd.concat([self.cases, self.weak], ignore_index=True)

    @property
    def every(self) -> pd.DataFrame:
        """Every row of every run: the cases, the batch curve and the weak cases."""
        return pd.concat([self.cases, self.curve, self.weak], ignore_index=True)


def _read_optional(path: Path, required: list[str]) -> pd.DataFrame | None:
    """A CSV that a run may lack; present but unreadable or missing columns is an error."""
    return read_table(path, required) if path.exists() else None


def _keyed(df: pd.DataFrame, label: str) -> pd.DataFrame:
    """``df`` with the run's label and a ``case_key`` unique across runs."""
    return df.assign(run_label=label, case_key=label + "/" + df["case_id"].astype(str))


def load_runs(run_dirs: list[Path]) -> Runs:
    """Read and check every run folder (raises ResultsError on an unusable one)."""
    envs: dict[str, dict[str, Any]] = {}
    names: dict[str, str] = {}
    cases: list[pd.DataFrame] = []
    samples: list[pd.DataFrame] = []
    timelines: list[pd.DataFrame] = []
    for i, run_dir in enumerate(run_dirs):
        if not run_dir.is_dir():
            raise ResultsError(f"{run_dir} is not a folder")
        # Run ids are long: compared runs get letters, which fit under a bar.
        label = run_dir.resolve().name if len(run_dirs) == 1 else chr(ord("A") + i % 26) * (
            1 + i // 26)
        names[label] = run_dir.resolve().name
        envs[label] = read_env(run_dir)
        run_cases = read_cases(run_dir)
        if run_cases.empty:
            raise ResultsError(f"{run_dir} holds no case yet: nothing to report")
        cases.append(_keyed(run_cases, label))
        _read_optional(run_dir / "steps.csv", ["case_id", "rank", "step", "step_time_s"])
        sampled = _read_optional(run_dir / "samples.csv", ["case_id", "device"])
        if sampled is not None:
            samples.append(_keyed(sampled, label))
        traced = _read_optional(run_dir / "timeline.csv", TIMELINE_COLUMNS)
        if traced is not None:
            timelines.append(_keyed(traced, label))
    every = pd.concat(cases, ignore_index=True)
    on_curve = every.batch_curve_of.notna()
    weak = every.scaling.eq("weak")
    return Runs(envs, names, every[~on_curve & ~weak].reset_index(drop=True),
                _concat(samples), _concat(timelines), every[on_curve].reset_index(drop=True),
                every[weak].reset_index(drop=True))


def _concat(frames: list[pd.DataFrame]) -> pd.DataFrame | None:
    """The runs' frames as one; None when no run has the file."""
    return pd.concat(frames, ignore_index=True) if frames else None


def caption(label: str, env: dict[str, Any], name: str | None = None) -> str:
    """One line naming the rig, devices and versions a run was measured with."""
    v, git = env.get("versions", {}), env.get("git", {})
    devices = env.get("device_names") or []
    names = ", ".join(sorted(set(devices))) if devices else "?"
    cuda = f"CUDA {v['cuda']}" if v.get("cuda") else "no CUDA"
    sha = (git.get("sha") or "nogit")[:7] + ("+dirty" if git.get("dirty") else "")
    head = label if name in (None, label) else f"{label} = {name}"
    return (f"{head}: rig {env.get('rig', {}).get('label', '?')} ({len(devices)}x {names}); "
            f"CPU {env.get('cpu_model', '?')}; torch {v.get('torch')}, torchvision "
            f"{v.get('torchvision')}, {cuda}; git {sha}")


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
            8: prediction.fig_prediction(swept), 9: bound_figure.fig_bound(swept),
            10: curve_figure.fig_batch_curve(runs.curve, c),
            11: waterfall_figure.fig_waterfall(swept),
            12: time_prediction.fig_time_prediction(swept)}
    return {n: f for n, f in figs.items() if f is not None}


def _png(fig: Figure, captions: list[str]) -> bytes:
    """The figure as PNG bytes, with the runs' rig and versions written under it.

    Laid out and written under the figures' style (``rc_context``): nothing global changes.
    """
    with matplotlib.rc_context(figures.STYLE):
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
    from bench_lib.report import distance_report

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
    from bench_lib.report.distance_report import is_distance_run

    if any(is_distance_run(d) for d in run_dirs):  # its own page too
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
