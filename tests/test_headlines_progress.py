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


def timed(r, low, high):
    """``r`` with a 95% interval of its throughput of [low, high] img/s (batch 32)."""
    return r | {"step_time_s_ci_low": 32 / high, "step_time_s_ci_high": 32 / low}


def test_a_clear_winner_a_tie_and_a_missing_interval():
    rows = [timed(row("single", 64, 10.0), 9.8, 10.2), timed(row("ddp", 64, 12.5), 12.2, 12.8),
            timed(row("pipeline", 64, 9.0, 8), 8.8, 9.2),
            timed(row("single", 128, 20.0), 19.5, 20.5), timed(row("ddp", 128, 53.6), 51.0, 55.9),
            timed(row("1f1b", 128, 52.1, 8, partition="balanced:9"), 49.8, 54.0),
            timed(row("single", 256, 5.0), 4.9, 5.1), row("ddp", 256, 6.0)]
    header, clear, tie, missing, *notes = headline_lines(rows)
    assert "vs runner-up" in header and "rough range" in header
    # clear: ddp's interval lies above the runner-up's (single here, the best other variant)
    assert "ddp 12.5 [12.2, 12.8] img/s > single 10.0 [9.8, 10.2]" in clear
    assert "1.25x [1.20, 1.31]" in clear and "tie" not in clear
    assert "tie: ddp 53.6 [51.0, 55.9] img/s ~ 1f1b[balanced] s8 52.1 [49.8, 54.0]" in tie
    assert "2.68x [2.49, 2.87]" in tie
    # no interval for ddp: no winner claimed, and no range for its speedup
    assert "best (no interval): ddp 6.0 img/s vs single 5.0 [4.9, 5.1]" in missing
    assert "1.20x " in missing and "1.20x [" not in missing and " > " not in missing
    text = " ".join(notes)
    assert "'tie': their intervals overlap" in text
    assert "rough range from the two medians' intervals" in text and "not a confidence" in text


def test_the_runner_up_is_another_variant_not_another_split():
    rows = [timed(row("pipeline", 64, 9.0, 8), 8.8, 9.2),
            timed(row("pipeline", 64, 8.9, 4), 8.7, 9.1),
            timed(row("pipeline", 64, 6.0, 4, partition="balanced:7"), 5.9, 6.1)]
    line = headline_lines(rows)[1]
    assert "pipeline s8 9.0 [8.8, 9.2] img/s > pipeline[balanced] s4 6.0" in line
    assert "n/a" in line  # no single: no speedup
    only = headline_lines([timed(row("ddp", 64, 9.0), 8.8, 9.2)])[1]
    assert "ddp 9.0 [8.8, 9.2] img/s (the only strategy that ran)" in only
