"""single's batch curve (issue 25, part 1): which points a sweep adds, how they are measured
with their workload, their per-image efficiency and its interval, and where they show.

The points are ``single`` cases at each per-device batch the sweep's cases compute
(``sweep.batch_curve``), measured in their workload's rounds; their rows carry
``batch_curve_of`` and ``per_image_efficiency``; the headlines leave them out and the report
draws them (figure 10).
"""

from __future__ import annotations

import json
import math
import random
import statistics

import pandas as pd
import pytest

from bench_lib.report.curve_figure import curve_points, fig_batch_curve
from bench_lib.report.headlines import headline_lines
from bench_lib.report.row_values import is_curve_point
from bench_lib.results.read import run_dirs_in
from bench_lib.results.schema import launch_medians
from bench_lib.rows.speedup_table import SpeedupTable
from bench_lib.rows.waterfall import PARTS
from bench_lib.sweep.cases import new_case
from bench_lib.sweep.expansion import expand, workload_groups
from bench_lib.sweep.profile import Profile
from tests.conftest import in_process


def _profile(**grid: object) -> Profile:
    base: dict[str, object] = {
        "strategies": ("single", "ddp", "fsdp", "mp", "accum", "gpipe", "1f1b"),
        "models": ("resnet-tiny",), "image_sizes": (32,), "batch_sizes": (16,),
        "split_sizes": (2, 4), "partitions": ("balanced",), "batch_curve": True}
    return Profile(**(base | grid))  # type: ignore[arg-type]


def _points(cases: list) -> dict[int, int | None]:
    return {c.batch_size: c.curve_of for c in cases if c.curve_of is not None}


def test_a_point_per_batch_a_device_computes_that_no_single_case_measures(cpu_rig):
    cases = expand(_profile(), cpu_rig)
    # ddp and fsdp: 8 images per rank; accum, gpipe, 1f1b: micro-batches of 2 and 4;
    # mp computes the whole batch: no point of its own.
    assert _points(cases) == {8: 16, 4: 16, 2: 16}
    assert {c.case_id for c in cases if c.curve_of} == {
        "single_resnet-tiny_img32_b8_s-_fp32", "single_resnet-tiny_img32_b4_s-_fp32",
        "single_resnet-tiny_img32_b2_s-_fp32"}
    # Each point is the workload's single case at the smaller batch, in its rounds: one
    # group, single first, then the points, then the others.
    (group,) = workload_groups(cases)
    order = [cases[i] for i in group]
    assert order[0].strategy == "single" and order[0].curve_of is None
    assert [c.curve_of for c in order[1:4]] == [16, 16, 16]
    assert all(c.strategy != "single" for c in order[4:])
    assert {c.device_batch_size for c in order[4:]} == {16, 8, 4, 2}


def test_no_point_where_the_sweep_measures_that_batch_or_has_no_single(cpu_rig):
    # ddp at 16 computes 8 per rank: single at 8 is a case of the sweep already.
    cases = expand(_profile(strategies=("single", "ddp"), batch_sizes=(8, 16)), cpu_rig)
    assert _points(cases) == {4: 8}  # ddp at 8: 4 per rank
    assert _points(expand(_profile(strategies=("ddp", "gpipe")), cpu_rig)) == {}
    assert _points(expand(_profile(batch_curve=False), cpu_rig)) == {}


def test_a_skipped_case_asks_for_no_point(cpu_rig):
    # batch 15 is not divisible by ddp's 2 ranks: ddp is skipped, so no point at 7.
    cases = expand(_profile(strategies=("single", "ddp", "accum"), batch_sizes=(15,),
                            split_sizes=(5,)), cpu_rig)
    assert _points(cases) == {5: 15}


def _row(case, medians: list[float]) -> dict[str, object]:
    return {"status": "ok", "launch_medians_s": ";".join(map(str, medians)),
            "step_time_s_median": statistics.median(medians)}


def test_a_point_gets_its_per_image_efficiency_and_no_speedup(cpu_rig):
    full = new_case(cpu_rig, "single", "resnet-tiny", 32, 16)
    point = new_case(cpu_rig, "single", "resnet-tiny", 32, 8).__class__(
        **(full.as_dict() | {"batch_size": 8, "curve_of": 16, "measurement": full.measurement}))
    ddp = new_case(cpu_rig, "ddp", "resnet-tiny", 32, 16)
    table = SpeedupTable()
    full_row, point_row = _row(full, [0.20, 0.22, 0.21]), _row(point, [0.15, 0.16, 0.155])
    table.fill(full, full_row)
    table.fill(point, point_row)
    ratios = [0.20 / 0.15, 0.22 / 0.16, 0.21 / 0.155]
    expected = 8 / 16 * math.exp(statistics.fmean(math.log(r) for r in ratios))
    assert point_row["per_image_efficiency"] == pytest.approx(expected)
    assert (point_row["per_image_efficiency_ci_low"] < expected
            < point_row["per_image_efficiency_ci_high"])
    assert "speedup_vs_single" not in point_row
    # The point is not the baseline of anything: ddp still compares with single at 16.
    ddp_row = _row(ddp, [0.12, 0.13, 0.125])
    table.fill(ddp, ddp_row)
    assert ddp_row["speedup_vs_single"] == pytest.approx(math.exp(statistics.fmean(
        math.log(a / b) for a, b in zip([0.20, 0.22, 0.21], [0.12, 0.13, 0.125]))))
    assert table.single_step_s(full) == pytest.approx(0.21, rel=0.05)
    # The waterfall's curve: single's step at the full batch and at the point.
    assert table.single_steps(ddp) == {16: 0.21, 8: 0.155}


def test_the_efficiency_interval_covers_the_true_efficiency_95_percent_of_the_time(cpu_rig):
    """Synthetic rounds: a true per-image efficiency of 0.45, each launch median off by
    lognormal noise (5%) and each round by a drift both cases share (pairing cancels it)."""
    full = new_case(cpu_rig, "single", "resnet-tiny", 32, 16)
    point = full.__class__(**(full.as_dict() | {"batch_size": 4, "curve_of": 16,
                                                "measurement": full.measurement}))
    true_step_full, true_eff = 0.2, 0.45
    true_step_point = true_step_full * (4 / 16) / true_eff
    rng = random.Random(7)
    trials, covered = 2000, 0
    for _ in range(trials):
        drift = [math.exp(rng.gauss(0, 0.1)) for _ in range(3)]
        a = [true_step_full * d * math.exp(rng.gauss(0, 0.05)) for d in drift]
        b = [true_step_point * d * math.exp(rng.gauss(0, 0.05)) for d in drift]
        table, full_row, point_row = SpeedupTable(), _row(full, a), _row(point, b)
        table.fill(full, full_row)
        table.fill(point, point_row)
        covered += (point_row["per_image_efficiency_ci_low"] <= true_eff
                    <= point_row["per_image_efficiency_ci_high"])
    assert 0.93 <= covered / trials <= 0.97


def _cases_frame() -> tuple[pd.DataFrame, pd.DataFrame]:
    common = {"run_label": "r", "model": "resnet50", "image_size": 64, "precision": "fp32",
              "status": "ok"}
    cases = pd.DataFrame([
        common | {"strategy": "single", "batch_size": 16, "device_batch_size": 16,
                  "step_time_s_median": 0.27, "step_time_s_ci_low": 0.26,
                  "step_time_s_ci_high": 0.28, "batch_curve_of": float("nan")},
        common | {"strategy": "ddp", "batch_size": 16, "device_batch_size": 8,
                  "step_time_s_median": 0.42, "step_time_s_ci_low": 0.40,
                  "step_time_s_ci_high": 0.44, "batch_curve_of": float("nan")},
        common | {"strategy": "gpipe", "batch_size": 16, "device_batch_size": 4,
                  "step_time_s_median": 0.6, "step_time_s_ci_low": 0.55,
                  "step_time_s_ci_high": 0.65, "batch_curve_of": float("nan")}])
    curve = pd.DataFrame([
        common | {"strategy": "single", "batch_size": 8, "device_batch_size": 8,
                  "batch_curve_of": 16.0, "step_time_s_median": 0.35,
                  "step_time_s_ci_low": 0.34, "step_time_s_ci_high": 0.36,
                  "per_image_efficiency": 0.386, "per_image_efficiency_ci_low": 0.37,
                  "per_image_efficiency_ci_high": 0.40},
        common | {"strategy": "single", "batch_size": 4, "device_batch_size": 4,
                  "batch_curve_of": 16.0, "step_time_s_median": 0.19,
                  "step_time_s_ci_low": 0.18, "step_time_s_ci_high": 0.20,
                  "per_image_efficiency": 0.355, "per_image_efficiency_ci_low": 0.33,
                  "per_image_efficiency_ci_high": 0.38}])
    return cases, curve


def test_the_curve_figure_draws_each_point_with_its_efficiency_and_users():
    cases, curve = _cases_frame()
    points = curve_points(curve, cases)
    assert points.device_batch.tolist() == [4, 8, 16]
    assert points.img_s.tolist() == pytest.approx([4 / 0.19, 8 / 0.35, 16 / 0.27])
    assert points.used_by.tolist() == ["gpipe", "ddp", ""]
    assert points.per_image_efficiency.tolist() == pytest.approx([0.355, 0.386, 1.0])
    fig = fig_batch_curve(curve, cases)
    assert fig is not None
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "39% [37%, 40%]\nddp" in texts and "36% [33%, 38%]\ngpipe" in texts
    assert fig_batch_curve(curve.iloc[0:0], cases) is None


def test_the_headlines_leave_the_curve_out():
    cases, curve = _cases_frame()
    rows = [dict(r) for _, r in pd.concat([cases, curve]).iterrows()]
    for r in rows:
        r.update(case_id=f"{r['strategy']}_{r['batch_size']}", throughput_img_s=(
            r["batch_size"] / r["step_time_s_median"]), launch_medians_s="")
    assert [is_curve_point(r) for r in rows] == [False, False, False, True, True]
    lines = headline_lines(rows)
    body = [line for line in lines if line.startswith("resnet50")]
    assert len(body) == 1 and " 16 " in body[0]  # one workload: batch 16, not 8 or 4


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_run_with_the_curve_and_weak_scaling_writes_their_rows_figures_and_sentences(
        tmp_path, capsys):
    profile = tmp_path / "curve.toml"
    profile.write_text('strategies = ["single", "ddp"]\nmodels = ["resnet-tiny"]\n'
                       "image_sizes = [32]\nbatch_sizes = [4]\nbatch_curve = true\n"
                       'scaling = ["strong", "weak"]\npredict_time = true\n'
                       "rig_figures = false\n"
                       "launches = 2\nwarmup_steps = 1\ntimed_steps = 2\n")
    proc = in_process(capsys, "run", "--rig", "cpu", "--profile", str(profile), "--out",
                      str(tmp_path / "out"), "--report")
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = run_dirs_in(tmp_path / "out")
    cases = pd.read_csv(run_dir / "cases.csv").set_index("case_id")
    point = cases.loc["single_resnet-tiny_img32_b2_s-_fp32"]
    assert point.batch_curve_of == 4 and point.status == "ok" and point.launches == 2
    assert 0 < point.per_image_efficiency_ci_low <= point.per_image_efficiency
    assert pd.isna(point.speedup_vs_single)
    assert cases.loc["ddp_resnet-tiny_img32_b4_s-_fp32", "device_batch_size"] == 2
    assert "per image" in proc.stderr and "(batch curve of 4)" in proc.stderr
    headlines = [line for line in proc.stderr.splitlines() if line.startswith("resnet-tiny")]
    assert [line.split()[4] for line in headlines] == ["strong", "weak"]
    assert (run_dir / "fig10_batch_curve.png").is_file()
    # The waterfall of ddp, its figure, and the answer in words in the terminal and report.
    ddp = cases.loc["ddp_resnet-tiny_img32_b4_s-_fp32"]
    parts = [ddp[f"waterfall_{p}_s"] for p in PARTS]
    assert PARTS == ("ideal", "batch", "optimizer", "corun", "imbalance", "bubble", "comm",
                     "own", "remainder")
    assert sum(parts) == pytest.approx(ddp.step_time_s_median)
    assert ddp.waterfall_ideal_s == pytest.approx(
        cases.loc["single_resnet-tiny_img32_b4_s-_fp32", "step_time_s_median"] / 2)
    assert (run_dir / "fig11_waterfall.png").is_file()
    words = " ".join(proc.stderr.split())  # the answer is folded to the terminal's width
    assert "32 px, batch 4: " in words and "lose most to" in words
    # Weak scaling: ddp with 4 images per rank, against single at 4 by throughput, round
    # by round; its waterfall starts from single's step at 4.
    weak = cases.loc["ddp_resnet-tiny_img32_b8_s-_fp32_weak"]
    single = cases.loc["single_resnet-tiny_img32_b4_s-_fp32"]
    assert (weak.scaling, weak.batch_size, weak.device_batch_size) == ("weak", 8, 4)
    assert ddp.scaling == "strong"
    rounds = [2 * a / b for a, b in zip(launch_medians(single.launch_medians_s),
                                        launch_medians(weak.launch_medians_s))]
    assert weak.speedup_vs_single == pytest.approx(statistics.geometric_mean(rounds))
    assert weak.scaling_efficiency == pytest.approx(weak.speedup_vs_single / 2)
    assert weak.waterfall_ideal_s == pytest.approx(single.step_time_s_median)
    assert "With 4 images per device (weak scaling), " in words
    report = (run_dir / "report.html").read_text()
    assert "In short" in report and "4 per device, weak scaling" in report
    assert (run_dir / "fig7_scaling.png").is_file()
    # No idle power or FLOP peak where the profile turns them off (rig_figures).
    env = json.loads((run_dir / "env.json").read_text())
    assert "rig_figures is off" in env["attainable_peak"]["unsupported"]
    assert "rig_figures is off" in env["idle_power"]["unsupported"]
    # Every ok case predicted before it ran (predict_time), from one calibration of the
    # workload at the sizes its strong and weak cases need, and scored after.
    cal = json.loads((run_dir / "calibration.json").read_text())["calibrations"]
    assert [c["key"]["image_size"] for c in cal] == [32] and cal[0]["devices"] == 2
    assert set(cal[0]["alone"]) == {"4", "2"} and set(cal[0]["together"]) == {"2", "4"}
    ok = cases[cases.status == "ok"]
    assert ok.step_time_s_predicted.notna().all() and (ok.step_time_s_predicted > 0).all()
    assert ok.prediction_error_pct.to_numpy() == pytest.approx(
        (100 * (ok.step_time_s_predicted / ok.step_time_s_median - 1)).to_numpy())
    assert ok.loc["single_resnet-tiny_img32_b4_s-_fp32", "speedup_predicted"] == 1.0
    assert ddp.prediction_note.startswith("ddp (collectives not overlapped")
    assert "step time predicted before launch: median |error|" in words
    assert (run_dir / "fig12_time_prediction.png").is_file()
    assert "how it was predicted" in report
