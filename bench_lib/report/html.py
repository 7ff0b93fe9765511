"""report.html: one self-contained page (inline CSS, figures as data: URIs, no script)."""

from __future__ import annotations

import datetime
import html
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pandas as pd

from bench_lib.analysis.utilisation import DISAGREE_POINTS
from bench_lib.report import bound_figure, memory_prediction, time_prediction
from bench_lib.report.answer import answer_lines
from bench_lib.report.figure_kit import records
from bench_lib.report.headlines import interval_note, speedup_note, speedup_text
from bench_lib.report.ranking import group_order, headline_groups, rank
from bench_lib.report.row_values import speedup, speedup_interval
from bench_lib.results.read import devices_label, provisional_round, provisional_words

if TYPE_CHECKING:
    from bench_lib.report.runs import Runs

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:2rem auto;max-width:1200px;
color:#222;padding:0 1rem;line-height:1.45}
h1{margin-bottom:.2rem}h2{border-bottom:1px solid #ddd;padding-bottom:.2rem;margin-top:2.2rem}
.sub{color:#666;margin-top:0}figure{margin:1rem 0}
figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption,.caption{color:#555;font-size:.85rem}
table{border-collapse:collapse;font-size:.85rem;margin:.6rem 0;width:100%}
th,td{border-bottom:1px solid #e4e4e4;padding:.25rem .5rem;text-align:left;vertical-align:top}
th{background:#f6f6f6}td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tr.notok td{background:repeating-linear-gradient(135deg,#fafafa 0 6px,#f0f0f0 6px 12px)}
.status{font-weight:600}.missing{color:#8a6d3b;background:#fcf8e3;padding:.5rem .8rem;
border-left:4px solid #e0c36c}.best{font-weight:600}
"""


def cell_text(value: object) -> str:
    """Escaped text; nothing for a missing value."""
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return ""
    return html.escape(str(value))


def cell_number(value: Any, fmt: str) -> str:
    """A number formatted with ``fmt``; nothing for a missing value."""
    return "" if value is None or pd.isna(value) else format(value, fmt)


def _headlines(cases: pd.DataFrame) -> str:
    """Per run and workload: the fastest strategy with its 95% interval, clear of the
    runner-up or a tie with it (``ranking.rank``: paired by round where both ran 2 or more
    launches), and its speedup over single with its 95% interval."""
    items = []
    groups = headline_groups(records(cases), by_run=True)
    for key, g in sorted(groups.items(), key=lambda kv: group_order(kv[0])):
        run, model, image, batch, precision, scaling = key
        per = f"{batch} per device, weak scaling" if scaling == "weak" else f"batch {batch}"
        head = f"{cell_text(run)} · {cell_text(model)} {image} px {per} {cell_text(precision)}: "
        found = rank(g)
        if found is None:
            items.append(f"<li>{head}no case ran</li>")
            continue
        lead, rest = found.describe("images/s")
        single = next((r for r in g if r["strategy"] == "single" and r["status"] == "ok"),
                      None)
        value = speedup(found.best, single)
        failed = sum(r["status"] != "ok" for r in g)
        items.append(
            f"<li>{head}<span class=best>{cell_text(lead)}</span> {cell_text(rest)}"
            + (f"; {speedup_text(value, speedup_interval(found.best))} vs single"
               if value is not None else "; no single baseline")
            + f" ({failed} of {len(g)} cases did not run)</li>")
    launches = [int(n) for n in cases.loc[cases.status == "ok", "launches"].dropna()]
    weak = any(key[-1] == "weak" for key in groups)
    return ("<ul>" + "".join(items) + "</ul><p class=caption>" + cell_text(interval_note(launches))
            + " " + cell_text(speedup_note(launches, weak)) + "</p>")


def _runs_table(envs: dict[str, dict[str, Any]], names: dict[str, str],
                cases: pd.DataFrame) -> str:
    """One row per run: rig, devices, versions, and how many cases ended how."""
    rows = []
    for label, env in envs.items():
        c = cases[cases.run_label == label]
        tally = ", ".join(f"{n} {s}" for s, n in c.status.value_counts().sort_index().items())
        v = env.get("versions", {})
        rows.append("<tr>" + "".join(f"<td>{cell_text(x)}</td>" for x in (
            label if label == names[label] else f"{label} = {names[label]}",
            env.get("rig", {}).get("label"), devices_label(env),
            env.get("cpu_model"), v.get("torch"), v.get("cuda") or "none",
            (env.get("git", {}).get("sha") or "")[:7], tally)) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("run", "rig", "devices", "CPU", "torch", "CUDA",
                                              "git", "cases"))
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _interval(low: Any, high: Any, fmt: str) -> str:
    """``low–high``; nothing where either end is missing."""
    if low is None or high is None or pd.isna(low) or pd.isna(high):
        return ""
    return f"{format(low, fmt)}–{format(high, fmt)}"


def _cases_table(cases: pd.DataFrame) -> str:
    """Every case of every run, failures hatched with their reason, then the strategy notes."""
    # (heading, the cell of a row, is it a number)
    cols: list[tuple[str, Callable[[dict[str, Any]], str], bool]] = [
        ("run", lambda r: cell_text(r["run_label"]), False),
        ("strategy", lambda r: cell_text(r["strategy"]), False),
        ("image (px)", lambda r: cell_text(r["image_size"]), False),
        ("batch", lambda r: cell_text(r["batch_size"]) + (" (weak)" if r.get("scaling") == "weak"
                                                     else ""), False),
        ("split", lambda r: cell_number(r["split_size"], ".0f"), True),
        ("status", lambda r: cell_text(r["status"]), False),
        ("launches", lambda r: cell_number(r["launches"], ".0f")
         + (" so far" if provisional_round(r.get("provisional")) else ""), True),
        ("median step (s)", lambda r: cell_number(r["step_time_s_median"], ".4f"), True),
        ("95% CI (s)", lambda r: _interval(r["step_time_s_ci_low"], r["step_time_s_ci_high"],
                                           ".4f"), True),
        ("throughput (img/s)", lambda r: cell_number(r["throughput_img_s"], ".1f"), True),
        ("speedup vs single", lambda r: cell_number(r["speedup_vs_single"], ".2f"), True),
        ("speedup 95% CI", lambda r: "" if r["strategy"] == "single" else
         _interval(r["speedup_ci_low"], r["speedup_ci_high"], ".2f"), True),
        ("peak mem net max (MiB)", lambda r: cell_number(r["peak_mem_net_mib_max"], ".0f"), True),
        ("reason", lambda r: cell_text(r["reason"]), False)]
    if cases.run_label.nunique() <= 1:
        cols = cols[1:]  # one run: no run column
    head = "".join(f"<th>{h}</th>" for h, _, _ in cols)
    body = []
    for r in records(cases):
        cells = "".join(f"<td class=num>{cell(r)}</td>" if number else
                        f"<td{' class=status' if h == 'status' else ''}>{cell(r)}</td>"
                        for h, cell, number in cols)
        cls = "" if r["status"] == "ok" else " class=notok"
        body.append(f"<tr{cls}>{cells}</tr>")
    notes = cases[cases.note.notna()].drop_duplicates(["strategy", "note"])
    items = "".join(f"<li><b>{cell_text(n.strategy)}</b>: {cell_text(n.note)}</li>"
                    for n in notes.itertuples())
    reading = f"<h3>How to read each strategy here</h3><ul>{items}</ul>" if items else ""
    caption = ("<p class=caption>95% CI: the t interval across the case's launches of its "
               "median step time (the geometric mean of the launch medians); the speedup's, "
               "across rounds of single's launch median over the case's in the same round. "
               "None with 1 launch.</p>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>{caption}{reading}"


def _signed_pct(value: Any) -> str:
    """``+4.2%``; nothing for a missing value."""
    text = cell_number(value, "+.1f")
    return f"{text}%" if text else ""


def _bubble_table(table: pd.DataFrame) -> str:
    """Measured per device beside the schedule's theory, per traced case (empty: no timeline)."""
    if table.empty:
        return ""
    head = ("<tr><th>run</th><th>case</th><th>devices</th><th>stages</th>"
            "<th>micro-batches</th><th>timeline span (s)</th><th>traced step vs median</th>"
            "<th>idle measured, mean of devices (min–max)</th><th>idle theoretical</th>"
            "<th>theory: formula, p devices, v stages each, m micro-batches</th></tr>")
    body = "".join(
        f"<tr><td>{cell_text(r.run)}</td><td>{cell_text(r.case_id)}</td>"
        f"<td class=num>{r.devices}</td>"
        f"<td class=num>{r.stages}</td><td class=num>{r.microbatches}</td>"
        f"<td class=num>{r.span_s:.4f}</td>"
        f"<td class=num>{_signed_pct(r.traced_vs_median_pct)}</td>"
        f"<td class=num>{r.bubble_measured:.1%} ({r.bubble_device_min:.1%}–"
        f"{r.bubble_device_max:.1%})</td>"
        f"<td class=num>{cell_number(r.bubble_theoretical, '.1%')}</td>"
        f"<td>{cell_text(r.theory)}</td></tr>" for r in table.itertuples())
    note = ("<p class=caption>A device idles whenever it runs no pass of any of its stages; "
            "its idle share is of the traced step's span (first start to last end over all "
            "devices). The theory assumes equal forward, input-gradient and weight-gradient "
            "times and free communication (bench_lib/analysis/bubble.py names the sources). "
            "On a cpu rig, mp and pipeline run their two stages one after another in one "
            "process, so they cannot overlap there.</p>")
    return (f"<h3>Idle (bubble) share per pipelined case</h3><table>{head}{body}</table>"
            f"{note}")


def _utilisation_check(cases: pd.DataFrame) -> str:
    """How many cases' utilisation was checked against their own compute, and those that
    disagree by over ``DISAGREE_POINTS``, with why (cases.csv ``util_check``)."""
    if "util_timeline_pct" not in cases or not cases.util_timeline_pct.notna().any():
        return ""
    checked = cases[cases.util_timeline_pct.notna()]
    flagged = checked[checked.util_check.fillna("").astype(str).str.strip() != ""]
    sources = sorted({str(s) for s in checked.util_source.dropna() if str(s)})
    said = (f"<p>Utilisation of {len(checked)} case{'s' * (len(checked) != 1)} checked "
            "against the share of the step its own compute takes (util_timeline_pct: ddp's "
            "compute-only steps, a pipeline's passes per device); "
            f"{len(flagged)} disagree{'s' * (len(flagged) == 1)} by over {DISAGREE_POINTS:g} "
            "points. Read from: "
            f"{cell_text(', '.join(sources) or 'unknown')}.</p>")
    if flagged.empty:
        return said
    body = "".join(
        f"<tr><td>{cell_text(r['case_id'])}</td>"
        f"<td class=num>{cell_number(r['util_pct_mean'], '.0f')}</td>"
        f"<td class=num>{cell_number(r['util_timeline_pct'], '.0f')}</td>"
        f"<td>{cell_text(r['util_check'])}</td></tr>" for r in records(flagged))
    return (f"{said}<table><tr><th>case</th><th>utilisation (%)</th><th>timeline busy (%)"
            f"</th><th>why they disagree</th></tr>{body}</table>")


def _section(s: dict[str, Any], extra: str) -> str:
    """One figure's heading and its image, or why it is absent."""
    title = f"<h2 id=fig{s['number']}>{s['number']}. {cell_text(s['title'])}</h2>"
    if not s["png_b64"]:
        return f"{title}<p class=missing>{cell_text(s['absent'])}.</p>{extra}"
    return (f"{title}<figure><img src=\"data:image/png;base64,{s['png_b64']}\" "
            f"alt=\"figure {s['number']}: {cell_text(s['title'])}\">"
            f"<figcaption>{cell_text(s['file'])} "
            f"(rig and versions under the figure and in the runs table)</figcaption></figure>"
            f"{extra}")


def _answer(runs: Runs) -> list[str]:
    """The answer in words (``report.answer``) at the top: empty where it has none."""
    lines = answer_lines(records(runs.every))
    if not lines:
        return []
    return ["<h2>In short</h2>", *(f"<p>{cell_text(line)}</p>" for line in lines)]


def _provisional(runs: Runs) -> list[str]:
    """A banner over a report of rows made before their workload's last round (a run still
    going, or stopped mid-workload): empty where every row is final."""
    words = provisional_words(runs.every.get("provisional", pd.Series(dtype=object)))
    if not words:
        return []
    return [f"<p class=missing>Some rows are {cell_text(words)}: their workload was still "
            "running when this report was written (or the run was stopped there); its final "
            "rows, with every launch, replace them (<code>run --resume</code> finishes a "
            "stopped run).</p>"]


def render(runs: Runs, sections: list[dict[str, Any]], captions: list[str],
           bubbles: pd.DataFrame) -> str:
    """The whole page."""
    labels = ", ".join(runs.names.values())
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    swept = runs.swept
    body = [f"<h1>parabench report</h1><p class=sub>{cell_text(labels)} · written {now}</p>",
            *_provisional(runs),
            "<h2>Runs</h2>", _runs_table(runs.envs, runs.names, swept),
            "<p class=caption>" + "<br>".join(cell_text(c) for c in captions) + "</p>",
            *_answer(runs), "<h2>Headlines</h2>", _headlines(swept)]
    for s in sections:
        extra = (_utilisation_check(swept) if s["number"] == 5
                 else _bubble_table(bubbles) if s["number"] == 6
                 else memory_prediction.error_html(swept) if s["number"] == 8
                 else bound_figure.explain_html(swept) if s["number"] == 9
                 else time_prediction.score_html(swept) if s["number"] == 12 else "")
        body.append(_section(s, extra))
    body += ["<h2 id=cases>All cases</h2><p class=caption>Hatched rows did not run; "
             "their reason is in the last column.</p>", _cases_table(swept)]
    return ("<!DOCTYPE html><html lang=en><head><meta charset=utf-8><link rel=icon href=\"data:,\">"
            "<meta name=viewport content=\"width=device-width, initial-scale=1\">"
            f"<title>parabench report: {cell_text(labels)}</title><style>{CSS}</style></head>"
            f"<body>{''.join(body)}</body></html>\n")
