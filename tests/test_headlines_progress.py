"""The end-of-run headlines and the progress ETA, on hand-made rows."""

from __future__ import annotations

import io

import pytest

from bench_lib.report.headlines import headline_lines, tutorial_lines
from bench_lib.run.progress import Progress


def row(strategy, img, thr, split="", status="ok", partition=""):
    return {"case_id": f"{strategy}_{img}_{split}", "model": "resnet50", "image_size": img,
            "batch_size": 32, "precision": "fp32", "strategy": strategy, "split_size": split,
            "status": status, "throughput_img_s": thr, "partition": partition}


def test_summary_names_best_strategy_speedup_and_best_splits():
    rows = [row("single", 64, 10.0), row("ddp", 64, 12.5), row("pipeline", 64, 8.0, 4),
            row("pipeline", 64, 9.0, 8), row("single", 128, 2.0),
            row("1f1b", 128, 3.3, 4, partition="tutorial:8"),
            row("1f1b", 128, 3.0, 8, partition="balanced:9"), row("dp", 128, None, "",
                                                                "unsupported")]
    header, line64, line128 = headline_lines(rows)
    assert "best split" in header
    assert "ddp" in line64 and "1.25x" in line64 and "pipeline 8" in line64
    assert "1f1b s4" in line128 and "1.65x" in line128
    assert "1f1b 4" in line128 and "1f1b[balanced] 8" in line128


def test_summary_reports_groups_without_results_and_failures():
    lines = headline_lines([row("single", 64, None, status="oom")])
    assert "no case ran (oom)" in lines[1]
    assert "1 case(s) failed" in lines[-1]


def test_eta_scales_remaining_estimates_by_measured_pace(monkeypatch):
    clock = iter([100.0, 130.0])  # start, then 30 s later
    monkeypatch.setattr("bench_lib.run.progress.time.monotonic", lambda: next(clock))
    progress = Progress([10.0, 20.0, 40.0], stream=io.StringIO())
    progress.done_estimate_s = 10.0  # the first case, estimated at 10 s, took 30 s
    assert progress.eta_s(1) == pytest.approx((20.0 + 40.0) * 3.0)


def test_quiet_and_non_terminal_output():
    out = io.StringIO()
    p = Progress([1.0], stream=out)
    assert p.bar is None  # not a terminal: plain lines, no bar
    p.case_done(0, type("C", (), {"describe": lambda self: "single x"})(),
                {"status": "skipped", "reason": "why"})
    assert "[1/1] single x: skipped (why)" in out.getvalue()
    quiet = io.StringIO()
    Progress([1.0], quiet=True, stream=quiet).header("hello")
    assert quiet.getvalue() == ""


def test_tutorial_lines_put_published_numbers_beside_ours():
    rows = [dict(row("single", 128, 40.0), batch_size=120, step_time_s_median=1.5),
            dict(row("pipeline", 128, 50.0, 20), batch_size=120, step_time_s_median=0.9)]
    text = "\n".join(tutorial_lines(rows))
    assert "single             tutorial 3.75 s   this machine 4.50 s" in text
    assert "pipeline split 20  tutorial 2.51 s   this machine 2.70 s" in text
    assert "pipeline split 12  tutorial 2.43 s   this machine not run" in text
