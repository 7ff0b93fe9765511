"""report.html: one self-contained page (inline CSS, figures as data: URIs, no script)."""

from __future__ import annotations

import datetime
import html
from typing import TYPE_CHECKING, Any

import pandas as pd

from bench_lib.report.figures import GROUP, records
from bench_lib.report.headlines import INTERVAL_NOTE, RANGE_RULE, rank, speedup_range

if TYPE_CHECKING:
    from bench_lib.report.build import Runs

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


def _e(value: object) -> str:
    """Escaped text; nothing for a missing value."""
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return ""
    return html.escape(str(value))


def _num(value: Any, fmt: str) -> str:
    """A number formatted with ``fmt``; nothing for a missing value."""
    return "" if value is None or pd.isna(value) else format(value, fmt)


def _headlines(cases: pd.DataFrame) -> str:
    """Per run and workload: the fastest strategy with its 95% interval, clear of the
    runner-up or a tie with it (``headlines.rank``), and its speedup over single."""
    items = []
    for key, g in sorted(cases.groupby(GROUP), key=lambda kv: kv[0]):
        run, model, image, batch, precision = key
        head = f"{_e(run)} · {_e(model)} {image} px batch {batch} {_e(precision)}: "
        found = rank(records(g))
        if found is None:
            items.append(f"<li>{head}no case ran</li>")
            continue
        lead, rest = found.describe("images/s")
        speed = _number_or_none(found.best.get("speedup_vs_single"))
        single = next((r for r in records(g[g.status == "ok"]) if r["strategy"] == "single"),
                      None)
        rough = speedup_range(found.best, single) if single is not None else None
        items.append(
            f"<li>{head}<span class=best>{_e(lead)}</span> {_e(rest)}"
            + ((f"; {speed:.2f}x single" + (
                f" (rough range {rough[0]:.2f}–{rough[1]:.2f}, from the two medians' 95% "
                "intervals)" if rough is not None else "")) if speed is not None
               else "; no single baseline")
            + f" ({(g.status != 'ok').sum()} of {len(g)} cases did not run)</li>")
    return ("<ul>" + "".join(items) + "</ul><p class=caption>" + _e(INTERVAL_NOTE) + " "
            + _e(f"The speedup's rough range is {RANGE_RULE}")
            + "</p>")


def _number_or_none(value: Any) -> float | None:
    """A number, or None for a missing value."""
    return None if value is None or pd.isna(value) else float(value)


def _runs_table(envs: dict[str, dict[str, Any]], names: dict[str, str],
                cases: pd.DataFrame) -> str:
    """One row per run: rig, devices, versions, and how many cases ended how."""
    rows = []
    for label, env in envs.items():
        c = cases[cases.run_label == label]
        tally = ", ".join(f"{n} {s}" for s, n in c.status.value_counts().sort_index().items())
        v = env.get("versions", {})
        rows.append("<tr>" + "".join(f"<td>{_e(x)}</td>" for x in (
            label if label == names[label] else f"{label} = {names[label]}",
            env.get("rig", {}).get("label"), ", ".join(env.get("device_names") or []),
            env.get("cpu_model"), v.get("torch"), v.get("cuda") or "none",
            (env.get("git", {}).get("sha") or "")[:7], tally)) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("run", "rig", "devices", "CPU", "torch", "CUDA",
                                              "git", "cases"))
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _cases_table(cases: pd.DataFrame) -> str:
    """Every case of every run, failures hatched with their reason, then the strategy notes."""
    # (heading, column, number format; "" for text)
    cols: list[tuple[str, str, str]] = [
        ("run", "run_label", ""), ("strategy", "strategy", ""),
        ("image (px)", "image_size", ""), ("batch", "batch_size", ""),
        ("split", "split_size", ".0f"), ("status", "status", ""),
        ("median step (s)", "step_time_s_median", ".4f"),
        ("95% CI (s)", "", ""), ("throughput (img/s)", "throughput_img_s", ".1f"),
        ("speedup vs single", "speedup_vs_single", ".2f"),
        ("peak mem net max (MiB)", "peak_mem_net_mib_max", ".0f"), ("reason", "reason", "")]
    first = 0 if cases.run_label.nunique() > 1 else 1  # one run: no run column
    head = "".join(f"<th>{h}</th>" for h, _, _ in cols[first:])
    body = []
    for r in records(cases):
        cells = []
        for _, col, fmt in cols[first:7]:
            value = r[col]
            cells.append(f"<td class=num>{_num(value, fmt)}</td>" if fmt else
                         f"<td{' class=status' if col == 'status' else ''}>{_e(value)}</td>")
        ci = (f"{r['step_time_s_ci_low']:.4f}–{r['step_time_s_ci_high']:.4f}"
              if pd.notna(r["step_time_s_ci_low"]) else "")
        cells.append(f"<td class=num>{ci}</td>")
        for _, col, fmt in cols[8:11]:
            cells.append(f"<td class=num>{_num(r[col], fmt)}</td>")
        cells.append(f"<td>{_e(r['reason'])}</td>")
        cls = "" if r["status"] == "ok" else " class=notok"
        body.append(f"<tr{cls}>{''.join(cells)}</tr>")
    notes = cases[cases.note.notna()].drop_duplicates(["strategy", "note"])
    items = "".join(f"<li><b>{_e(n.strategy)}</b>: {_e(n.note)}</li>" for n in notes.itertuples())
    reading = f"<h3>How to read each strategy here</h3><ul>{items}</ul>" if items else ""
    return f"<table><tr>{head}</tr>{''.join(body)}</table>{reading}"


def _signed_pct(value: Any) -> str:
    """``+4.2%``; nothing for a missing value."""
    text = _num(value, "+.1f")
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
        f"<tr><td>{_e(r.run)}</td><td>{_e(r.case_id)}</td><td class=num>{r.devices}</td>"
        f"<td class=num>{r.stages}</td><td class=num>{r.microbatches}</td>"
        f"<td class=num>{r.span_s:.4f}</td>"
        f"<td class=num>{_signed_pct(r.traced_vs_median_pct)}</td>"
        f"<td class=num>{r.bubble_measured:.1%} ({r.bubble_device_min:.1%}–"
        f"{r.bubble_device_max:.1%})</td><td class=num>{_num(r.bubble_theoretical, '.1%')}</td>"
        f"<td>{_e(r.theory)}</td></tr>" for r in table.itertuples())
    note = ("<p class=caption>A device idles whenever it runs no pass of any of its stages; "
            "its idle share is of the traced step's span (first start to last end over all "
            "devices). The theory assumes equal forward, input-gradient and weight-gradient "
            "times and free communication (bench_lib/measure/bubble.py names the sources). "
            "On a cpu rig, mp and pipeline run their two stages one after another in one "
            "process, so they cannot overlap there.</p>")
    return (f"<h3>Idle (bubble) share per pipelined case</h3><table>{head}{body}</table>"
            f"{note}")


def _section(s: dict[str, Any], extra: str) -> str:
    """One figure's heading and its image, or why it is absent."""
    title = f"<h2 id=fig{s['number']}>{s['number']}. {_e(s['title'])}</h2>"
    if not s["png_b64"]:
        return f"{title}<p class=missing>{_e(s['absent'])}.</p>{extra}"
    return (f"{title}<figure><img src=\"data:image/png;base64,{s['png_b64']}\" "
            f"alt=\"figure {s['number']}: {_e(s['title'])}\"><figcaption>{_e(s['file'])} "
            f"(rig and versions under the figure and in the runs table)</figcaption></figure>"
            f"{extra}")


def render(runs: Runs, sections: list[dict[str, Any]], captions: list[str],
           bubbles: pd.DataFrame) -> str:
    """The whole page."""
    labels = ", ".join(runs.names.values())
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    body = [f"<h1>parabench report</h1><p class=sub>{_e(labels)} · written {now}</p>",
            "<h2>Runs</h2>", _runs_table(runs.envs, runs.names, runs.cases),
            "<p class=caption>" + "<br>".join(_e(c) for c in captions) + "</p>",
            "<h2>Headlines</h2>", _headlines(runs.cases)]
    for s in sections:
        body.append(_section(s, _bubble_table(bubbles) if s["number"] == 6 else ""))
    body += ["<h2 id=cases>All cases</h2><p class=caption>Hatched rows did not run; "
             "their reason is in the last column.</p>", _cases_table(runs.cases)]
    return ("<!DOCTYPE html><html lang=en><head><meta charset=utf-8><link rel=icon href=\"data:,\">"
            "<meta name=viewport content=\"width=device-width, initial-scale=1\">"
            f"<title>parabench report: {_e(labels)}</title><style>{CSS}</style></head>"
            f"<body>{''.join(body)}</body></html>\n")
