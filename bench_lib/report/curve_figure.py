"""single's batch curve: one device's images/s against the images it computes at once.

Per workload (model, image size, full batch, precision; a panel each, compared runs as lines
of their own), ``single``'s throughput at the full batch and at each per-device batch the
workload's cases compute (the batch-curve rows, ``batch_curve_of``; ``sweep.batch_curve``), with
the 95% interval of each step time as error bars. Each smaller batch is labelled with its
per-image efficiency against the full batch (``per_image_efficiency``: 100% = a device
loses nothing with fewer images at once; its interval paired by round) and the strategies
whose devices compute that many images at once. Reads cases.csv only; never imports torch.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from bench_lib.report.figure_kit import PALETTE, facets, strategy_order, styled, workload_title

KEY = ["run_label", "model", "image_size", "full_batch", "precision"]


def _used_by(cases: pd.DataFrame) -> dict[tuple[object, ...], str]:
    """Per (run, model, image, full batch, precision, device batch): the strategies whose
    devices compute that batch, e.g. ``ddp, fsdp``."""
    if "device_batch_size" not in cases:
        return {}
    ran = cases[(cases.strategy != "single") & cases.device_batch_size.notna()
                & cases.status.isin(["ok", "oom", "timeout", "error"])]
    out: dict[tuple[object, ...], str] = {}
    for key, g in ran.groupby(["run_label", "model", "image_size", "batch_size", "precision",
                               "device_batch_size"]):
        out[tuple(key)] = ", ".join(strategy_order(g.strategy.unique()))
    return out


def curve_points(curve: pd.DataFrame, cases: pd.DataFrame) -> pd.DataFrame:
    """One row per measured point of each workload's curve: ``device_batch``, throughput
    (img/s) with its interval, per-image efficiency with its interval (1 at the full
    batch), and ``used_by``; the full batch's point is the workload's own ``single`` row."""
    ok = curve[curve.status == "ok"]
    if ok.empty:
        return pd.DataFrame()
    points = ok.assign(full_batch=ok.batch_curve_of.astype(int))
    fulls = []
    keys: list[tuple[Any, ...]] = list(points[KEY].drop_duplicates().itertuples(
        index=False, name=None))
    for run, model, image, full, precision in keys:
        single = cases[(cases.run_label == run) & (cases.strategy == "single")
                       & (cases.status == "ok") & (cases.model == model)
                       & (cases.image_size == image) & (cases.batch_size == full)
                       & (cases.precision == precision)]
        if not single.empty:
            fulls.append(single.iloc[[0]].assign(full_batch=full, per_image_efficiency=1.0,
                                                 per_image_efficiency_ci_low=1.0,
                                                 per_image_efficiency_ci_high=1.0))
    both = pd.concat([points, *fulls], ignore_index=True)
    both["device_batch"] = both.batch_size.astype(int)
    step = both.step_time_s_median.astype(float)
    both["img_s"] = both.device_batch / step
    both["img_s_low"] = both.device_batch / both.step_time_s_ci_high.astype(float)
    both["img_s_high"] = both.device_batch / both.step_time_s_ci_low.astype(float)
    used = _used_by(cases)
    both["used_by"] = [used.get((r.run_label, r.model, r.image_size, r.full_batch,
                                 r.precision, r.device_batch), "")
                       for r in both.itertuples()]
    ordered: pd.DataFrame = both.sort_values([*KEY, "device_batch"]).reset_index(drop=True)
    return ordered


def _percent(value: float, low: float, high: float) -> str:
    interval = "" if pd.isna(low) or pd.isna(high) else f" [{low:.0%}, {high:.0%}]"
    return f"{value:.0%}{interval}"


@styled
def fig_batch_curve(curve: pd.DataFrame, cases: pd.DataFrame) -> Figure | None:
    """images/s of one device against its batch, per workload (module docstring); None
    where the runs measured no batch curve."""
    points = curve_points(curve, cases)
    if points.empty:
        return None
    workloads: list[tuple[Any, ...]] = sorted(set(points[
        ["model", "image_size", "full_batch", "precision"]].itertuples(index=False, name=None)))
    runs = sorted(points.run_label.unique())
    fig, axes = facets(len(workloads), width=5.6, height=4.2, max_cols=2)
    for ax, workload in zip(axes, workloads):
        model, image, full, precision = workload
        mine = points[(points.model == model) & (points.image_size == image)
                      & (points.full_batch == full) & (points.precision == precision)]
        for i, run in enumerate(runs):
            line = mine[mine.run_label == run]
            if line.empty:
                continue
            color = PALETTE[i % len(PALETTE)]
            err = [(line.img_s - line.img_s_low).clip(lower=0).fillna(0),
                   (line.img_s_high - line.img_s).clip(lower=0).fillna(0)]
            ax.errorbar(line.device_batch, line.img_s, yerr=err, marker="o", color=color,
                        capsize=3, label=run if len(runs) > 1 else None)
            top = line[line.device_batch == full]
            if not top.empty:
                ax.axhline(float(top.img_s.iloc[0]), color=color, linestyle=":", linewidth=1)
            for r in line.itertuples():
                if r.device_batch == full:
                    text = f"batch {int(full)}: 100%"
                else:
                    text = _percent(r.per_image_efficiency, r.per_image_efficiency_ci_low,
                                    r.per_image_efficiency_ci_high)
                text += f"\n{r.used_by}" if r.used_by else ""
                ax.annotate(text, (r.device_batch, r.img_s), textcoords="offset points",
                            xytext=(0, -26), ha="center", fontsize=7, color="#333333")
        ax.set_xscale("log", base=2)
        ticks = sorted(mine.device_batch.unique())
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlim(min(ticks) / 1.5, max(ticks) * 1.5)
        ax.set_ylim(bottom=0)
        ax.set_title(workload_title(workload), fontsize=10)
        ax.set_xlabel("images one device computes at once (its batch or micro-batch)")
        ax.set_ylabel("images/s, one device (single)")
        if len(runs) > 1:
            ax.legend(fontsize=8)
    fig.suptitle("single's batch curve: what a device keeps of its per-image speed with "
                 "fewer images at once (% of the full batch's, 95% interval)", fontsize=10)
    return fig
