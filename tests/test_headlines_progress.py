"""The end-of-run headlines and the progress ETA, on hand-made rows."""

from __future__ import annotations

import io
import itertools

import pytest

from bench_lib.analysis.stats import launch_interval, paired_ratio_interval
from bench_lib.launch.protocol import CaseOutcome
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


class FakeCase:
    strategy = "ddp"

    def describe(self):
        return "ddp x"


def test_eta_scales_remaining_launch_estimates_by_measured_pace(monkeypatch):
    clock = iter([100.0, 130.0, 130.0])  # start, then 30 s later (the line, then the check)
    monkeypatch.setattr("bench_lib.run.progress.time.monotonic", lambda: next(clock))
    out = io.StringIO()
    progress = Progress([10.0, 20.0, 40.0], stream=out, launches=[2, 2, 2])
    # The first launch of the first case, estimated at 10 / 2 = 5 s, took 30 s: pace 6.
    progress.launch_done(0, FakeCase(), 0, CaseOutcome("ok", step_times_s=[0.3, 0.1, 0.2]))
    assert progress.eta_s() == pytest.approx((70.0 - 5.0) * 6.0)
    assert "  ddp x launch 1/2: median 0.200 s/step over 3 steps | ETA ~6.5 min" in out.getvalue()


def test_each_launch_and_case_gets_a_line_with_its_intervals():
    out = io.StringIO()
    p = Progress([4.0, 2.0], stream=out, launches=[2, 1])
    p.launch_start(0, FakeCase(), 0)  # no bar: nothing to show until it ends
    assert out.getvalue() == ""
    p.launch_done(0, FakeCase(), 1, CaseOutcome("oom", "rank 0: out of memory"))
    assert "ddp x launch 2/2: oom: rank 0: out of memory" in out.getvalue()
    p.case_done(0, FakeCase(), {"status": "ok", "step_time_s_median": 0.25,
                                "step_time_s_ci_low": 0.24, "step_time_s_ci_high": 0.26,
                                "throughput_img_s": 128.0, "speedup_vs_single": 1.5,
                                "speedup_ci_low": 1.4, "speedup_ci_high": 1.6})
    p.case_done(1, FakeCase(), {"status": "ok", "step_time_s_median": 0.25,
                                "step_time_s_ci_low": "", "step_time_s_ci_high": "",
                                "throughput_img_s": 128.0, "speedup_vs_single": 1.5,
                                "speedup_ci_low": "", "speedup_ci_high": ""})
    lines = out.getvalue().splitlines()
    assert lines[-2] == ("[1/2] ddp x: ok (0.250 [0.240, 0.260] s/step, 128.0 img/s, "
                         "1.50x [1.40, 1.60] vs single)")
    assert lines[-1] == "[2/2] ddp x: ok (0.250 s/step, 128.0 img/s, 1.50x vs single)"


def test_quiet_and_non_terminal_output():
    out = io.StringIO()
    p = Progress([1.0], stream=out)
    assert p.bar is None  # not a terminal: plain lines, no bar
    p.case_done(0, type("C", (), {"describe": lambda self: "single x"})(),
                {"status": "skipped", "reason": "why"})
    assert "[1/1] single x: skipped (why)" in out.getvalue()
    quiet = io.StringIO()
    q = Progress([1.0], quiet=True, stream=quiet)
    q.header("hello")
    q.launch_done(0, FakeCase(), 0, CaseOutcome("ok", step_times_s=[0.1]))
    assert quiet.getvalue() == ""


def test_eta_drops_the_launches_a_failed_case_will_not_run(monkeypatch):
    clock = itertools.count(100.0, 10.0)  # 10 s between readings
    monkeypatch.setattr("bench_lib.run.progress.time.monotonic", lambda: next(clock))
    p = Progress([30.0, 10.0], stream=io.StringIO(), launches=[3, 1])
    p.launch_done(0, FakeCase(), 0, CaseOutcome("oom", "out of memory"))  # rounds 1, 2: none
    assert p.dropped_estimate_s == pytest.approx(20.0)  # rounds 1 and 2 of case 0: 2 x 10 s
    p.launch_done(1, FakeCase(), 0, CaseOutcome("ok", step_times_s=[0.1]))
    p.case_done(0, FakeCase(), {"status": "oom", "reason": "out of memory"})
    p.case_done(1, FakeCase(), {"status": "ok", "step_time_s_median": 0.1,
                                "throughput_img_s": 10.0})
    assert p.eta_s() == 0.0  # everything ran


def test_tutorial_lines_put_published_numbers_beside_ours():
    rows = [dict(row("single", 128, 40.0), batch_size=120, step_time_s_median=1.5),
            dict(row("pipeline", 128, 50.0, 20), batch_size=120, step_time_s_median=0.9)]
    text = "\n".join(tutorial_lines(rows))
    assert "single             tutorial 3.75 s   this machine 4.50 s" in text
    assert "pipeline split 20  tutorial 2.51 s   this machine 2.70 s" in text
    assert "pipeline split 12  tutorial 2.43 s   this machine not run" in text


def timed(r, low, high):
    """``r`` with a 95% interval of its throughput of [low, high] img/s (batch 32), 1 launch."""
    return r | {"step_time_s_ci_low": 32 / high, "step_time_s_ci_high": 32 / low}


def launched(r, medians, single=None):
    """``r`` measured in len(medians) rounds, its figures as the runner makes them: the step
    time and its t interval from the launch medians, the speedup paired with ``single``'s."""
    step = launch_interval(medians)
    r = r | {"launches": len(medians), "launch_medians_s": ";".join(f"{m:g}" for m in medians),
             "step_time_s_median": step.point, "step_time_s_ci_low": step.low,
             "step_time_s_ci_high": step.high, "throughput_img_s": 32 / step.point}
    if single is not None:
        sp = paired_ratio_interval(single, medians)
        r |= {"speedup_vs_single": sp.point, "speedup_ci_low": sp.low,
              "speedup_ci_high": sp.high}
    return r


def test_with_one_launch_a_tie_is_overlapping_intervals():
    rows = [timed(row("single", 64, 10.0), 9.8, 10.2), timed(row("ddp", 64, 12.5), 12.2, 12.8),
            timed(row("pipeline", 64, 9.0, 8), 8.8, 9.2),
            timed(row("single", 128, 20.0), 19.5, 20.5), timed(row("ddp", 128, 53.6), 51.0, 55.9),
            timed(row("1f1b", 128, 52.1, 8, partition="balanced:9"), 49.8, 54.0),
            timed(row("single", 256, 5.0), 4.9, 5.1), row("ddp", 256, 6.0)]
    header, clear, tie, missing, *notes = headline_lines(rows)
    assert "vs runner-up" in header and "vs single [95% CI]" in header
    assert "rough range" not in " ".join(headline_lines(rows))
    # clear: ddp's interval lies above the runner-up's (single here, the best other variant)
    assert "ddp 12.5 [12.2, 12.8] img/s > single 10.0 [9.8, 10.2]  " in clear
    assert "paired" not in clear  # one launch: nothing to pair
    # 1 launch: no speedup interval either, the speedup alone
    assert " 1.25x " in clear and "1.25x [" not in clear and "tie" not in clear
    assert "tie: ddp 53.6 [51.0, 55.9] img/s ~ 1f1b[balanced] s8 52.1 [49.8, 54.0]" in tie
    assert " 2.68x " in tie
    # no interval for ddp: no winner claimed, and no interval for its speedup
    assert "best (no interval): ddp 6.0 img/s vs single 5.0 [4.9, 5.1]" in missing
    assert "1.20x " in missing and "1.20x [" not in missing and " > " not in missing
    text = " ".join(notes)
    assert "95% t interval across its launches" in text
    assert "With 1 launch: 'tie' when the two cases' intervals overlap" in text
    assert "vs single [low, high]" not in text  # no speedup interval shown: not explained


def test_paired_rounds_decide_clear_or_tie_where_the_intervals_overlap():
    # Round 2 ran 10% slow for everyone (drift): each case's own interval is wide.
    drift = [1.0, 1.1, 1.0]
    single = [3.2 * d for d in drift]
    clear = [2.56 * d for d in drift]
    runner_up = [m * f for m, f in zip(clear, [1.04, 1.05, 1.045], strict=True)]
    rows = [launched(row("single", 64, 0), single, single),
            launched(row("ddp", 64, 0), clear, single),
            launched(row("pipeline", 64, 0, 8), runner_up, single)]
    header, line, *notes = headline_lines(rows)
    # Their intervals overlap (the old rule's tie: ddp's low end under the pipeline's high) ...
    # ... but round by round the pipeline is 4-5% slower every time: clear.
    assert "ddp 12.1 [10.6, 13.9] img/s > pipeline s8 11.6 [10.0, 13.4] (paired 1.04x " \
        "[1.03, 1.06])" in line
    assert "1.25x [1.25, 1.25]" in line  # the same drift in single's rounds cancels
    text = " ".join(notes)
    assert "95% t interval across 3 launches" in text and "'tie' when that interval holds 1" in text
    assert "its 95% t interval across 3 rounds" in text

    # Round to round it goes either way: a tie, though the medians differ by 2%.
    mixed = [m * f for m, f in zip(clear, [1.04, 0.99, 1.03], strict=True)]
    rows[2] = launched(row("pipeline", 64, 0, 8), mixed, single)
    line = headline_lines(rows)[1]
    assert "tie: ddp 12.1 [10.6, 13.9] img/s ~ pipeline s8 11.9 [11.0, 12.8] (paired 1.02x " \
        "[0.96, 1.09])" in line


def test_pairing_falls_back_to_overlap_under_two_launches_of_either():
    single = [3.2, 3.5, 3.2]
    rows = [launched(row("single", 64, 0), single, single),
            launched(row("ddp", 64, 0), [2.56, 2.8, 2.56], single),
            timed(row("pipeline", 64, 10.0, 8), 9.8, 10.2) | {"launches": 1,
                                                              "launch_medians_s": 3.2}]
    line = headline_lines(rows)[1]
    # The pipeline ran 1 launch: the two intervals are apart, so clear, by the overlap rule.
    assert "ddp 12.1 [10.7, 13.8] img/s > pipeline s8 10.0 [9.8, 10.2]  " in line
    assert "paired" not in line


def test_the_runner_up_is_another_variant_not_another_split():
    rows = [timed(row("pipeline", 64, 9.0, 8), 8.8, 9.2),
            timed(row("pipeline", 64, 8.9, 4), 8.7, 9.1),
            timed(row("pipeline", 64, 6.0, 4, partition="balanced:7"), 5.9, 6.1)]
    line = headline_lines(rows)[1]
    assert "pipeline s8 9.0 [8.8, 9.2] img/s > pipeline[balanced] s4 6.0" in line
    assert "n/a" in line  # no single: no speedup
    only = headline_lines([timed(row("ddp", 64, 9.0), 8.8, 9.2)])[1]
    assert "ddp 9.0 [8.8, 9.2] img/s (the only strategy that ran)" in only


def test_ddp_knob_variants_are_strategy_variants_of_their_own():
    from bench_lib.report.row_values import case_name

    plain = {"strategy": "ddp", "ddp_bucket_cap_mb": "default", "ddp_comm_hook": "none",
             "ddp_gradient_as_bucket_view": 0, "ddp_static_graph": 0}
    assert case_name(plain) == "ddp"
    assert case_name({"strategy": "ddp"}) == "ddp"  # a run before the knobs
    knobs = {"ddp_bucket_cap_mb": "100", "ddp_gradient_as_bucket_view": 1,
             "ddp_comm_hook": "powersgd-r1"}
    assert case_name(plain | knobs) == "ddp+bucket100+gradview+powersgd-r1"
    assert case_name(plain | {"ddp_bucket_cap_mb": 50.0, "ddp_static_graph": 1.0}
                     ) == "ddp+bucket50+static"
