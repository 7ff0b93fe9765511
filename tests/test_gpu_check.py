"""benchmarks/gpu_check.py, the GPU session's one command: its checks of a run folder's rows
on hand-made GPU rows (the sweeps themselves need a GPU)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bench_lib.results.schema import CASE_COLUMNS

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(**cols: object) -> dict:
    good = {"case_id": "ddp_resnet50_img128_b32_s-_fp32", "strategy": "ddp", "status": "ok",
            "step_time_s_median": "0.05", "util_pct_mean": "71.0",
            "util_source": "gpm-sm-activity", "util_timeline_pct": "80", "util_check": "",
            "power_w_mean": "410", "energy_j_per_img": "0.6", "energy_j_per_img_net": "0.4",
            "mfu_pct": "38.0", "peak_mem_reserved_mib_max": "5120", "sampler_note": "",
            "stop_reason": "min_time", "throttled": ""}
    return {c: "" for c in CASE_COLUMNS} | good | {k: str(v) for k, v in cols.items()}


ENV = {"rig": {"kind": "cuda", "label": "cuda:2", "gpu_slots": 1},
       "attainable_peak": {"tflop_s": {"fp32": 51.0}},
       "idle_power": {"watts": {"0": 70.0}}, "device_names": ["NVIDIA H100 80GB HBM3"]}


def test_a_complete_gpu_row_has_no_problem(gpu_check):
    assert gpu_check.run_problems([_row()], ENV) == []


def test_each_missing_gpu_figure_is_a_problem_with_the_rows_reason(gpu_check):
    bare = _row(util_pct_mean="", util_source="", power_w_mean="", energy_j_per_img="",
                energy_j_per_img_net="", mfu_pct="", mfu_note="no peak",
                peak_mem_reserved_mib_max="", sampler_note="NVML unavailable (no driver)")
    found = gpu_check.run_problems([bare], ENV)
    assert [p.split(": ", 1)[1].split(" (")[0] for p in found] == [
        "no utilisation", "no power_w_mean", "no energy_j_per_img", "no energy_j_per_img_net",
        "no mfu_pct", "no CUDA allocator peak"]
    assert "NVML unavailable (no driver)" in found[0]
    cpu_time = gpu_check.run_problems([_row(util_source="cpu-time")], ENV)
    assert cpu_time == [f"{_row()['case_id']}: utilisation from 'cpu-time', not a GPU counter"]
    pipeline = _row(case_id="1f1b_x", strategy="1f1b", bubble_measured_pct="",
                    note="no timeline: trace failed")
    assert gpu_check.run_problems([pipeline], ENV) == [
        "1f1b_x: no measured bubble (no timeline: trace failed)"]


def test_failed_cases_and_a_bare_env_are_problems_and_unsupported_is_not(gpu_check):
    rows = [_row(case_id="a", status="error", reason="CUDA error: no kernel image"),
            _row(case_id="b", status="unsupported", reason="needs 2 GPUs"),
            _row(case_id="c", status="oom", reason="CUDA out of memory")]
    assert gpu_check.run_problems(rows, ENV) == [
        "a: error: CUDA error: no kernel image", "c: oom: CUDA out of memory"]
    bare = ENV | {"attainable_peak": {"unsupported": "probe failed"},
                  "idle_power": {"unsupported": "no counter"}}
    assert gpu_check.run_problems([], bare) == [
        "env.json: no measured FLOP peak (probe failed)", "env.json: no idle power (no counter)"]
    cpu = ENV | {"rig": {"kind": "cpu", "label": "cpu:2x1t"}}
    assert gpu_check.run_problems([_row()], cpu) == [
        "rig 'cpu:2x1t' is not a cuda rig: no GPU path ran"]


def test_the_validation_mode_may_leave_what_it_says_empty(gpu_check):
    slots = ENV | {"rig": {"kind": "cuda", "label": "cuda:1 (2 slots)", "gpu_slots": 2},
                   "attainable_peak": {"tflop_s": {"fp32": 25.0}, "note": "a share"}}
    shared = _row(power_w_mean="", energy_j_per_img="", energy_j_per_img_net="", mfu_pct="",
                  sampler_note="validation run (--gpu-slots 2): the case's 2 slots share 1 "
                               "GPU, each sampled once per slot: power and energy left empty")
    assert gpu_check.run_problems([shared], slots) == []
    unlabelled = slots | {"attainable_peak": {"tflop_s": {"fp32": 25.0}}}
    assert gpu_check.run_problems([], unlabelled) == [
        "env.json: the validation mode's FLOP peak is not labelled as a share"]
    # Outside it, the same empty energy is a problem.
    assert len(gpu_check.run_problems([shared | {"sampler_note": ""}], ENV)) == 4


def test_checking_run_folders_prints_each_case_and_exits_by_its_problems(gpu_check, tmp_path,
                                                                         capsys):
    import csv

    run = tmp_path / "run"
    run.mkdir()
    with (run / "cases.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, CASE_COLUMNS)
        w.writeheader()
        w.writerow(_row(util_check="utilisation 98% is 38 points above ..."))
    (run / "env.json").write_text(json.dumps(ENV))
    assert gpu_check.main(["--runs", str(run)]) == 0
    out = capsys.readouterr().out
    assert "util 71% [gpm-sm-activity], timeline busy 80%" in out
    assert "! utilisation 98% is 38 points above" in out and "0 problems in 1 run folder" in out
    (run / "env.json").write_text(json.dumps(ENV | {"idle_power": {"unsupported": "none"}}))
    assert gpu_check.main(["--runs", str(run)]) == 1


def test_without_a_gpu_it_runs_nothing_and_exits_2(gpu_check, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(gpu_check, "gpus_visible", lambda: 0)
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA GPU visible" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
