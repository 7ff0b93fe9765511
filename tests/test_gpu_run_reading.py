"""The reading side on the first GPU run's real cuda-rig folders (tests/data/h100-2026-11-26:
one H100, torch 2.11), which no machine without a GPU can write: results.read, the headlines,
the report, compare and its baseline store, and the same-job gate's reading of rounds. The
answer's words, the device labels and gpu_check have tests of their own (test_answer,
test_device_labels, test_gpu_check)."""

from __future__ import annotations

import json
import shutil

import pytest

from bench_lib import commands, exit_codes
from bench_lib.compare import paired
from bench_lib.compare.baseline import save_baseline, stored_hardware
from bench_lib.compare.output import busy_cases, run_compare
from bench_lib.compare.plan import ComparePlan
from bench_lib.compare.runs import load_run
from bench_lib.gate.rounds import reusable_calibration
from bench_lib.report.headlines import headline_lines
from bench_lib.results.fingerprint import hardware_of
from bench_lib.results.read import read_cases, read_env
from tests.conftest import REPO

GPU_RUN = REPO / "tests" / "data" / "h100-2026-11-26"
FOLDERS = ("smoke-1gpu", "smoke-2slots", "resnet50-224-single-accum")
TWO_LAUNCHES = "resnet50-224-single-accum"  # --launches 2; the smoke runs measured 1


@pytest.mark.parametrize("name", FOLDERS)
def test_results_read_takes_a_cuda_run_folder(name):
    run_dir = GPU_RUN / name
    env = read_env(run_dir)
    assert env["rig"]["kind"] == "cuda" and all("H100" in n for n in env["device_names"])
    cases = read_cases(run_dir)
    ok = cases[cases.status == "ok"]
    assert len(ok) >= 3 and set(cases.status) <= {"ok", "unsupported"}
    # What only a GPU writes: the caching allocator's peaks (its reservation holds what it
    # allocated) and utilisation from GPM SM activity.
    assert (ok.peak_mem_source == "cuda-allocator").all()
    assert (ok.peak_mem_reserved_mib_max >= ok.peak_mem_mib_max).all()
    assert (ok.util_source == "gpm-sm-activity").all()
    assert ok.util_pct_mean.between(0, 100).all()
    # Two readers of one figure agree: cases.csv's step time is the geometric mean of the
    # launch medians that compare reads from steps.csv (slowest rank per step).
    run = load_run(run_dir)
    assert set(run.launches) == set(ok.case_id)
    for row in ok.itertuples():
        assert len(run.launches[row.case_id]) == row.launches
        assert run.median_s(row.case_id) == pytest.approx(row.step_time_s_median, rel=1e-9)


@pytest.mark.parametrize("name", FOLDERS)
def test_a_cuda_runs_intervals_come_from_its_launches(name):
    ok = read_cases(GPU_RUN / name).query("status == 'ok'")
    if name == TWO_LAUNCHES:
        assert (ok.step_time_s_ci_low < ok.step_time_s_median).all()
        assert (ok.step_time_s_median < ok.step_time_s_ci_high).all()
        assert (ok.step_time_ci_method == "t over 2 launches").all()
    else:  # one launch: no interval rather than one over correlated steps
        assert ok.step_time_s_ci_low.isna().all() and ok.step_time_s_ci_high.isna().all()


def test_the_headlines_of_the_224_px_run_carry_its_intervals():
    """The figures the evidence README states (single, ResNet50 224 px, batch 120)."""
    lines = headline_lines(read_cases(GPU_RUN / TWO_LAUNCHES).to_dict("records"))
    by_workload = {tuple(line.split()[:4]): line for line in lines}
    fp32 = by_workload["resnet50", "224", "120", "fp32"]
    bf16 = by_workload["resnet50", "224", "120", "bf16"]
    assert "single 1769.1 [1760.8, 1777.5] img/s" in fp32
    assert "single 2092.8 [1996.2, 2194.1] img/s" in bf16
    assert "the 95% t interval across 2 launches" in " ".join(lines)
    (smoke,) = [line for line in headline_lines(
        read_cases(GPU_RUN / "smoke-1gpu").to_dict("records")) if line.startswith("resnet50")]
    assert "no interval" in smoke and "single 392.7" in smoke


@pytest.mark.integration
@pytest.mark.parametrize("name", FOLDERS)
def test_the_report_of_a_cuda_run_folder(tmp_path, capsys, name):
    run_dir = shutil.copytree(GPU_RUN / name, tmp_path / name)  # it writes into the folder
    assert commands.main(["report", str(run_dir)]) == exit_codes.EXIT_OK
    assert capsys.readouterr().out.strip() == str(run_dir / "report.html")
    html = (run_dir / "report.html").read_text()
    env = read_env(run_dir)
    assert f"<td>{env['rig']['label']}</td>" in html and "NVIDIA H100 80GB HBM3" in html
    assert "<td>2.11.0+cu130</td>" in html  # the torch that measured it
    figures = {p.name for p in run_dir.glob("fig*.png")}
    assert {"fig1_throughput.png", "fig4_memory.png", "fig5_samples.png"} <= figures
    # A figure for what the run measured, none for what it did not.
    assert ("fig6_timeline.png" in figures) == (run_dir / "timeline.csv").is_file()
    assert ("fig12_time_prediction.png" in figures) == env["profile"]["predict_time"]
    assert not (GPU_RUN / name / "report.html").exists()  # the test data stay as they were


@pytest.mark.parametrize("name", FOLDERS)
def test_a_cuda_run_compared_with_itself_is_no_regression(tmp_path, capsys, name):
    run_dir = GPU_RUN / name
    markdown, bench_json = tmp_path / "compare.md", tmp_path / "compare.json"
    assert run_compare(ComparePlan(run_dir, run_dir, markdown=markdown,
                                   json_path=bench_json)) == 0
    out = capsys.readouterr().out
    ok = int((read_cases(run_dir).status == "ok").sum())
    assert out.rstrip().endswith(f"PASS: {ok} unchanged")
    method = ("welch over launches, 2 vs 2 launches" if name == TWO_LAUNCHES
              else "bootstrap over steps (1 launch: launch-to-launch spread not included)")
    assert method in out
    assert f"PASS: {ok} unchanged" in markdown.read_text()
    assert len(json.loads(bench_json.read_text())) >= ok


def test_a_busy_machines_cases_are_named_so_that_each_can_be_told_apart():
    # The 224 px run's single and accum in fp32 and bf16 all spread over 10%: by strategy
    # the note read "single 20%, accum 21%, single 14%, accum 21%".
    busy = busy_cases(load_run(GPU_RUN / TWO_LAUNCHES))
    assert len(busy) == 4 and len({entry.split()[0] for entry in busy}) == 4
    assert all(entry.split()[0].endswith(("_fp32", "_bf16")) for entry in busy)


def test_one_gpu_and_two_slots_on_it_are_different_hardware(capsys):
    assert run_compare(ComparePlan(GPU_RUN / "smoke-1gpu", GPU_RUN / "smoke-2slots")) == 2
    err = capsys.readouterr().err
    assert "different hardware" in err and "'cuda:1' vs 'cuda:2slots-on-1gpu-validation'" in err


def test_a_cuda_run_is_its_hardwares_baseline_in_the_store(tmp_path, capsys):
    run_dir, store = GPU_RUN / TWO_LAUNCHES, tmp_path / "store"
    stored = save_baseline(run_dir, store)
    assert stored_hardware(stored) == hardware_of(read_env(run_dir)["fingerprint"])
    # the store resolves to this hardware's baseline
    assert run_compare(ComparePlan(store, run_dir)) == 0
    # another rig: none stored for it
    assert run_compare(ComparePlan(store, GPU_RUN / "smoke-2slots")) == 2
    assert "no baseline for this hardware" in capsys.readouterr().err


def test_the_same_job_gate_reads_cuda_rounds(tmp_path):
    """Three rounds a side, each the smoke run on one GPU: every case that ran is unchanged
    by the paired rounds, the others n/a with their status, and each round's contention
    is said with its round."""
    run = load_run(GPU_RUN / "smoke-1gpu")
    base = paired.side_run(tmp_path / "base", [run] * 3)
    head = paired.side_run(tmp_path / "head", [run] * 3)
    results = paired.judge_cases(base, head, 5.0, "auto")
    verdicts = {r.case_id: (r.verdict, r.by) for r in results}
    ran = {cid for cid, row in run.cases.items() if row["status"] == "ok"}
    assert {verdicts[cid][0] for cid in ran} == {"unchanged"}
    assert {verdicts[cid] for cid in set(verdicts) - ran} == {("n/a", "base status unsupported")}
    assert paired.method_line(results, 3) == (
        "95% intervals: t over 3 of 3 rounds of head over base, paired by round")
    contended = next(n for n in paired.gate_notes(results, base, head) if "the base was" in n)
    assert "round 1: other processes used 52%" in contended and "round 3: " in contended
    assert reusable_calibration(GPU_RUN / TWO_LAUNCHES) == (
        GPU_RUN / TWO_LAUNCHES / "calibration.json")  # it names its hardware
    assert reusable_calibration(GPU_RUN / "smoke-1gpu") is None  # it predicted nothing
