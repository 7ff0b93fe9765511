"""benchmarks/gpu_check.py, a GPU box's one command, on CPU: its checks of run folders (on
hand-made GPU rows and on the first GPU run's real folders), the sweeps it builds, the test
shards it plans and runs (with a stand-in for pytest), the one verdict, and on a fake
two-GPU box its plan (every strategy's two-GPU test and sweep, within 15 minutes by its
estimate) and its run of the pre-flight, the tests and the sweep."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from bench_lib.commands.parser import build_parser
from bench_lib.fault_hooks import QUICK_PEAK_ENV
from bench_lib.gpu_check import folders, plan, shards, sweeps, testsuite
from bench_lib.gpu_check.shards import PytestShard, ShardResult
from bench_lib.gpu_check.verdict import Verdict
from bench_lib.prediction.duration import format_duration
from bench_lib.results.schema import CASE_COLUMNS
from bench_lib.rig import Rig
from bench_lib.sweep.profile import load_profile, profile_path
from tests.conftest import REPO

SCRIPT = REPO / "benchmarks" / "gpu_check.py"
EVIDENCE = REPO / "tests" / "data" / "h100-2026-11-26"
EVIDENCE_RUNS = ("smoke-1gpu", "smoke-2slots", "resnet50-224-single-accum")


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(**cols: object) -> dict:
    good = {"case_id": "ddp_resnet50_img128_b32_s-_fp32", "strategy": "ddp", "status": "ok",
            "world_size": "2", "step_time_s_median": "0.05", "util_pct_mean": "71.0",
            "util_source": "gpm-sm-activity", "util_timeline_pct": "80", "util_check": "",
            "power_w_mean": "410", "energy_j_per_img": "0.6", "energy_j_per_img_net": "0.4",
            "mfu_pct": "38.0", "peak_mem_reserved_mib_max": "5120", "sampler_note": "",
            "stop_reason": "min_time", "throttled": ""}
    return {c: "" for c in CASE_COLUMNS} | good | {k: str(v) for k, v in cols.items()}


ENV = {"rig": {"kind": "cuda", "label": "cuda:2", "gpu_slots": 1, "num_devices": 2},
       "attainable_peak": {"tflop_s": {"fp32": 51.0}},
       "idle_power": {"watts": {"0": 70.0}}, "device_names": ["NVIDIA H100 80GB HBM3"] * 2,
       "profile": {"name": "gpu-check", "rig_figures": True},
       "collectives": {"backend": "nccl", "ops": {}}, "test_hooks": {}}


# --- what a run folder must hold ----------------------------------------------------------

def test_a_complete_gpu_row_has_no_problem():
    assert folders.run_problems([_row()], ENV) == []


def test_each_missing_gpu_figure_is_a_problem_with_the_rows_reason():
    bare = _row(util_pct_mean="", util_source="", power_w_mean="", energy_j_per_img="",
                energy_j_per_img_net="", mfu_pct="", mfu_note="no peak",
                peak_mem_reserved_mib_max="", sampler_note="NVML unavailable (no driver)")
    found = folders.run_problems([bare], ENV)
    assert [p.split(": ", 1)[1].split(" (")[0] for p in found] == [
        "no utilisation", "no power_w_mean", "no energy_j_per_img", "no energy_j_per_img_net",
        "no mfu_pct", "no CUDA allocator peak"]
    assert "NVML unavailable (no driver)" in found[0]
    cpu_time = folders.run_problems([_row(util_source="cpu-time")], ENV)
    assert cpu_time == [f"{_row()['case_id']}: utilisation from 'cpu-time', not a GPU counter"]
    pipeline = _row(case_id="1f1b_x", strategy="1f1b", bubble_measured_pct="",
                    note="no timeline: trace failed")
    assert folders.run_problems([pipeline], ENV) == [
        "1f1b_x: no measured bubble (no timeline: trace failed)"]


def test_failed_cases_and_a_bare_env_are_problems_and_unsupported_is_not():
    rows = [_row(case_id="a", status="error", reason="CUDA error: no kernel image"),
            _row(case_id="b", status="unsupported", reason="needs 2 GPUs"),
            _row(case_id="c", status="oom", reason="CUDA out of memory")]
    assert folders.run_problems(rows, ENV) == [
        "a: error: CUDA error: no kernel image", "c: oom: CUDA out of memory"]
    bare = ENV | {"attainable_peak": {"unsupported": "probe failed"},
                  "idle_power": {"unsupported": "no counter"}}
    assert folders.run_problems([], bare) == [
        "env.json: no measured FLOP peak (probe failed)", "env.json: no idle power (no counter)"]
    # A row's MFU and net energy come from those: their absence is the run's one problem.
    assert folders.run_problems([_row(mfu_pct="", energy_j_per_img_net="")], bare) == [
        "env.json: no measured FLOP peak (probe failed)", "env.json: no idle power (no counter)"]
    cpu = ENV | {"rig": {"kind": "cpu", "label": "cpu:2x1t"}}
    assert folders.run_problems([_row()], cpu) == [
        "rig 'cpu:2x1t' is not a cuda rig: no GPU path ran"]
    hooked = ENV | {"test_hooks": {QUICK_PEAK_ENV: "1"}}
    assert folders.run_problems([_row()], hooked) == [
        f"env.json: made with test-only hooks set ({QUICK_PEAK_ENV}): not a real measurement"]


def test_missing_collectives_are_a_problem_only_where_a_case_is_priced_with_them():
    skipped = ENV | {"collectives": {"skipped": "collective micro-benchmark failed (gloo)"}}
    assert folders.run_problems([_row()], skipped) == [
        "env.json: no collectives measured (collective micro-benchmark failed (gloo)): the "
        "bounds of ddp_resnet50_img128_b32_s-_fp32 are missing or count no communication"]
    one_device = _row(world_size="1")
    mp_on_slots = _row(case_id="mp_x", strategy="mp", bubble_measured_pct="10")
    slots = skipped | {"rig": ENV["rig"] | {"gpu_slots": 2},
                       "attainable_peak": {"tflop_s": {"fp32": 25.0}, "note": "a share"}}
    assert folders.run_problems([one_device], skipped) == []
    assert folders.run_problems([mp_on_slots | {"mfu_pct": ""}], slots) == []  # .to() moves nothing
    assert len(folders.run_problems([mp_on_slots], skipped)) == 1  # two GPUs: it moves


def test_the_validation_mode_may_leave_what_it_says_empty():
    slots = ENV | {"rig": {"kind": "cuda", "label": "cuda:2slots-on-1gpu-validation",
                           "gpu_slots": 2, "num_devices": 2},
                   "attainable_peak": {"tflop_s": {"fp32": 25.0}, "note": "a share"}}
    shared = _row(power_w_mean="", energy_j_per_img="", energy_j_per_img_net="", mfu_pct="",
                  sampler_note="validation run (--gpu-slots 2): the case's 2 slots share 1 "
                               "GPU, each sampled once per slot: power and energy left empty")
    assert folders.run_problems([shared], slots) == []
    unlabelled = slots | {"attainable_peak": {"tflop_s": {"fp32": 25.0}}}
    assert folders.run_problems([], unlabelled) == [
        "env.json: the validation mode's FLOP peak is not labelled as a share"]
    # Outside it, the same empty energy is a problem.
    assert len(folders.run_problems([shared | {"sampler_note": ""}], ENV)) == 4


def _write_run(run: Path, rows: list[dict], env: dict) -> Path:
    run.mkdir()
    with (run / "cases.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, CASE_COLUMNS)
        w.writeheader()
        w.writerows(rows)
    (run / "env.json").write_text(json.dumps(env))
    return run


def test_checking_run_folders_prints_each_case_and_exits_by_its_problems(gpu_check, tmp_path,
                                                                         capsys):
    run = _write_run(tmp_path / "run", [_row(util_check="utilisation 98% is 38 points above")],
                     ENV)
    assert gpu_check.main(["--runs", str(run)]) == 0
    out = capsys.readouterr().out
    assert "util 71% [gpm-sm-activity], timeline busy 80%" in out
    assert "! utilisation 98% is 38 points above" in out
    assert "verdict: TRUST this box's figures (checked 1 run folder; not the test suite)" in out
    (run / "env.json").write_text(json.dumps(ENV | {"idle_power": {"unsupported": "none"}}))
    assert gpu_check.main(["--runs", str(run)]) == 1
    assert "DO NOT TRUST" in capsys.readouterr().out
    assert gpu_check.main(["--runs", str(tmp_path / "nowhere")]) == 2
    assert "not a run folder (no cases.csv)" in capsys.readouterr().err


# --- the first GPU run's own folders ------------------------------------------------------

def test_the_evidence_folders_problems_are_the_true_ones_and_say_why(gpu_check, capsys):
    runs = [str(EVIDENCE / name) for name in EVIDENCE_RUNS]
    assert gpu_check.main(["--runs", *runs]) == 1
    out = capsys.readouterr().out
    verdict = out[out.index("verdict: "):].splitlines()
    assert verdict[:2] == ["verdict: DO NOT TRUST this box's figures (checked 3 run folders; "
                           "not the test suite)", "  3 problems in the run folders:"]
    found = [line.strip() for line in verdict[2:]]
    # Made with the smoke profile (rig figures off): one problem each, saying so, and none
    # per row for the MFU those figures would have given; the slots' collectives crashed.
    off = ("env.json: rig figures not measured (profile 'smoke' has rig_figures = false): no "
           "FLOP peak and no idle power, so no row has MFU or net energy")
    assert found[0].startswith(f"{runs[0]}: {off}")
    assert found[1].startswith(f"{runs[1]}: {off}")
    assert found[2].startswith(f"{runs[1]}: env.json: no collectives measured (collective "
                               "micro-benchmark failed (rank 0 exited with -6")
    assert found[2].endswith("the bounds of ddp_resnet50_img64_b8_s-_fp32 are missing or "
                             "count no communication")
    assert ("(cuda:2slots-on-1gpu-validation, 1x NVIDIA H100 80GB HBM3 shared by 2 slots "
            "(validation mode))") in out


def _as_measured(src: Path, dst: Path) -> Path:
    """A copy of evidence folder ``src`` with what a run measuring its rig figures (and the
    validation mode's collectives) writes: env.json's FLOP peak and idle power, each ok row's
    MFU (outside the validation mode) and net energy (where it has energy)."""
    shutil.copytree(src, dst)
    env = json.loads((dst / "env.json").read_text())
    slots = env["rig"]["gpu_slots"] > 1
    env["profile"]["rig_figures"] = True
    env["attainable_peak"] = {"tflop_s": {"fp32": {"0": 402.4}}} | (
        {"note": "each slot probed at once: a share of the card"} if slots else {})
    env["idle_power"] = {"watts": {"0": 70.96}, "seconds": 2.0, "sources": ["nvml gpu 0"]}
    if slots:
        env["collectives"] = {"backend": "gloo", "world_size": 2, "ops": {}}
    (dst / "env.json").write_text(json.dumps(env))
    with (dst / "cases.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    for row in (r for r in rows if r["status"] == "ok"):
        row["mfu_pct"] = row["mfu_pct"] or ("" if slots else "2.5")
        if row["energy_j_per_img"]:
            row["energy_j_per_img_net"] = row["energy_j_per_img_net"] or "0.1"
    with (dst / "cases.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return dst


def test_the_evidence_folders_with_their_rig_figures_measured_pass(gpu_check, tmp_path, capsys):
    runs = [str(_as_measured(EVIDENCE / name, tmp_path / name)) for name in EVIDENCE_RUNS]
    assert gpu_check.main(["--runs", *runs]) == 0, capsys.readouterr().out
    assert "verdict: TRUST this box's figures" in capsys.readouterr().out


# --- the sweeps it runs -------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(sweeps.SWEEPS))
def test_each_sweep_measures_the_rig_figures_it_is_checked_for(name, tmp_path):
    command = sweeps.sweep_command(name, tmp_path)
    assert command[:4] == [sys.executable, "-m", "bench_lib", "run"]
    args = build_parser().parse_args(command[3:])
    profile = load_profile(profile_path(args.profile_flag, "cuda"))
    assert profile.rig_figures, f"{name}: {args.profile_flag} does not measure rig figures"
    assert args.out == tmp_path / name
    # The tests' quick FLOP probe (conftest sets it here) is not the sweeps'.
    assert os.environ.get(QUICK_PEAK_ENV) and QUICK_PEAK_ENV not in sweeps.sweep_env()


def test_an_earlier_checks_folder_is_not_taken_for_a_sweep_that_wrote_none(tmp_path,
                                                                          monkeypatch):
    earlier = tmp_path / "smoke" / "20260101T000000Z_run-gpu-check"
    earlier.mkdir(parents=True)
    (tmp_path / "smoke" / "latest-run").symlink_to(earlier.name)
    monkeypatch.setattr(sweeps.subprocess, "call", lambda *a, **k: 2)
    assert sweeps.run_check_sweep("smoke", tmp_path, REPO) == (
        None, "`run` exited 2 and wrote no run folder")


def test_without_a_gpu_it_runs_nothing_and_exits_2(gpu_check, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(sweeps, "gpus_visible", lambda: 0)
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA GPU visible" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--no-sweeps", "--no-tests"])
    assert stop.value.code == 2


# --- the test shards ----------------------------------------------------------------------

def test_cores_are_grouped_two_by_two_and_a_spare_core_joins_the_last_group():
    assert shards.core_groups(range(16)) == [(2 * i, 2 * i + 1) for i in range(8)]
    assert shards.core_groups([0, 1, 2, 3, 4]) == [(0, 1), (2, 3, 4)]
    assert shards.core_groups([7]) == [(7,)]


def _kinds() -> dict[str, str]:
    kinds = {}
    for f in range(3):  # three slow files of 4 slow tests
        kinds |= {f"tests/test_slow{f}.py::test_{i}": "slow" for i in range(4)}
    for f in range(10):  # ten files of unit tests
        kinds |= {f"tests/test_unit{f}.py::test_{i}": "unit" for i in range(20)}
    kinds["tests/test_gpu.py::test_a"] = "gpu"
    kinds["tests/test_gpu.py::test_b"] = "skip"
    return kinds


def test_shards_deal_whole_files_heaviest_first_so_the_slow_files_spread():
    kinds = _kinds()
    planned = shards.deal_shards(kinds, range(6))  # 3 shards of 2 cores
    assert [s.cores for s in planned] == [(0, 1), (2, 3), (4, 5)]
    assert [sum("slow" in t for t in s.tests) for s in planned] == [1, 1, 1]
    # Every file in exactly one shard, whole: nothing run twice, nothing left out.
    dealt = [t for s in planned for t in s.tests]
    assert sorted(dealt) == sorted({t.split("::")[0] for t in kinds})
    assert max(s.weight_s for s in planned) - min(s.weight_s for s in planned) <= 15.0


def test_a_file_heavier_than_a_shard_is_cut_into_functions_then_cases():
    kinds = {f"tests/test_big.py::test_models[m{i}]": "slow" for i in range(6)}
    kinds |= {"tests/test_big.py::test_other": "integration",
              "tests/test_small.py::test_x": "integration"}
    planned = shards.deal_shards(kinds, range(4))  # 2 shards: 98 s in all, 49 s a shard
    dealt = sorted(t for s in planned for t in s.tests)
    # The file over 49 s cut into its functions, the function over 49 s into its cases.
    assert dealt == sorted([*list(kinds)[:7], "tests/test_small.py"])
    assert {len([t for t in s.tests if "test_models[" in t]) for s in planned} == {3}
    light = shards.units({"tests/test_big.py::test_models[a]": "slow",
                          "tests/test_big.py::test_models[b]": "slow"}, limit_s=100.0)
    assert light == {"tests/test_big.py": 60.0}
    # A case id pytest's command line could misread is not cut out of its function.
    odd = {"tests/test_docs.py::test_cmd[a::b]": "slow", "tests/test_docs.py::test_cmd[c]": "slow"}
    assert shards.units(odd, limit_s=1.0) == {"tests/test_docs.py::test_cmd": 60.0}


def test_a_junit_case_maps_back_to_its_pytest_id():
    files = {"tests/test_a.py", "tests/sub/test_b.py"}
    assert shards.node_id("tests.test_a", "test_x[p-1]", files) == "tests/test_a.py::test_x[p-1]"
    assert shards.node_id("tests.sub.test_b.TestK", "test_y", files) == (
        "tests/sub/test_b.py::TestK::test_y")
    assert shards.node_id("", "tests.test_a", files) == "tests/test_a.py"  # collection error


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1"
failures="1" skipped="2" tests="5"><testcase classname="tests.test_a" name="test_ok" time="1"/>
<testcase classname="tests.test_a" name="test_bad[x]" time="1"><failure message="assert 0"/>
</testcase><testcase classname="tests.test_a" name="test_gpu" time="0"><skipped
type="pytest.skip" message="needs a CUDA GPU; none is visible"/></testcase><testcase
classname="tests.test_a" name="test_two" time="0"><skipped type="pytest.skip"
message="needs 2 CUDA GPUs; 1 visible"/></testcase><testcase classname="" name="tests.test_c"
time="0"><error message="collection failure"/></testcase></testsuite></testsuites>"""


def test_a_junit_report_gives_passed_skipped_failed_and_gpu_skips(tmp_path):
    report = tmp_path / "shard0.xml"
    report.write_text(JUNIT)
    assert shards.read_junit(report, {"tests/test_a.py", "tests/test_c.py"}) == (
        1, 2, ("tests/test_a.py::test_bad[x]", "tests/test_c.py"), 1)


FAKE_PYTEST = """
import os, sys
report = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--junitxml="))
tests = [a for a in sys.argv[1:] if a.startswith("tests/")]
print("cores", sorted(os.sched_getaffinity(0)), "tests", tests, flush=True)
if any("hang" in t for t in tests):
    import time; time.sleep(60)
cases = "".join(
    f'<testcase classname="tests.{t[6:-3]}" name="t">' + ('<failure message="no"/>' if "bad" in t
                                                         else "") + "</testcase>"
    for t in tests)
open(report, "w").write(f"<testsuites><testsuite>{cases}</testsuite></testsuites>")
sys.exit(1 if any("bad" in t for t in tests) else 0)
"""


@pytest.mark.integration
def test_each_shard_runs_pinned_to_its_cores_and_a_shard_over_time_is_stopped(tmp_path,
                                                                             monkeypatch):
    fake = tmp_path / "fake_pytest.py"
    fake.write_text(FAKE_PYTEST)
    monkeypatch.setattr(testsuite, "PYTEST", [sys.executable, str(fake)])
    cores = sorted(os.sched_getaffinity(0))
    plan = [PytestShard(0, (cores[0],), ("tests/test_good.py",), 1.0),
            PytestShard(1, (cores[-1],), ("tests/test_bad.py", "tests/test_ok.py"), 1.0),
            PytestShard(2, (cores[0],), ("tests/test_hang.py",), 1.0)]
    collection = testsuite.Collection(dict.fromkeys(
        ["tests/test_good.py::t", "tests/test_bad.py::t", "tests/test_ok.py::t",
         "tests/test_hang.py::t"], "unit"))
    said: list[str] = []
    results = testsuite.run_shards(plan, collection, tmp_path, tmp_path, timeout_s=3.0,
                                   say=said.append)
    assert [(r.passed, r.failed, r.returncode) for r in results[:2]] == [
        (1, (), 0), (1, ("tests/test_bad.py::t",), 1)]
    assert f"cores [{cores[0]}]" in results[0].log.read_text()
    assert f"cores [{cores[-1]}]" in results[1].log.read_text()
    assert results[2].returncode is None and "stopped at its time limit" in results[2].problem
    assert any(line.startswith("  shard 1 (cores") and "1 failed, 1 passed" in line
               for line in said)
    summary = testsuite.write_summary(results, tmp_path).read_text()
    assert "FAILED tests/test_bad.py::t" in summary


@pytest.mark.integration
def test_the_collection_weighs_each_test_by_its_markers(tmp_path, monkeypatch):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text(
        "import pytest\n"
        "def pytest_collection_modifyitems(items):\n"
        "    for item in items:\n"
        "        if 'gpu' in item.keywords:\n"
        "            item.add_marker(pytest.mark.skip(reason='needs a CUDA GPU'))\n")
    (tmp_path / "tests" / "test_k.py").write_text(
        "import pytest\n"
        "def test_unit(): pass\n"
        "@pytest.mark.slow\n@pytest.mark.integration\ndef test_slow(): pass\n"
        "@pytest.mark.integration\ndef test_integ(): pass\n"
        "@pytest.mark.gpu\ndef test_gpu(): pass\n")
    (tmp_path / "tests" / "test_broken.py").write_text("import no_such_module\n")
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the plugin, from this checkout
    found = testsuite.collect(tmp_path, tmp_path)
    assert found.kinds == {"tests/test_k.py::test_unit": "unit",
                           "tests/test_k.py::test_slow": "slow",
                           "tests/test_k.py::test_integ": "integration",
                           "tests/test_k.py::test_gpu": "skip"}
    assert found.errors == ("tests/test_broken.py",)


# --- the one verdict ----------------------------------------------------------------------

def _shard_result(index: int, failed: tuple[str, ...] = (), problem: str = "",
                  gpu_skipped: int = 0) -> ShardResult:
    shard = PytestShard(index, (2 * index, 2 * index + 1), (f"tests/test_{index}.py",), 10.0)
    return ShardResult(shard, 1 if failed else 0, 12.0, Path(f"shard{index}.log"),
                       passed=20, skipped=1, failed=failed, gpu_skipped=gpu_skipped,
                       problem=problem)


def test_the_verdict_trusts_only_where_nothing_stands_against_it():
    clean = Verdict((), 2, (_shard_result(0), _shard_result(1)))
    assert clean.trusted and clean.lines() == [
        "verdict: TRUST this box's figures (checked 2 run folders; the test suite with the "
        "GPU visible (40 passed, 0 failed, 2 skipped, in 2 shards))"]
    bad = Verdict(("smoke: env.json: no idle power (x)",), 2,
                  (_shard_result(0, failed=("tests/test_0.py::test_y",)),
                   _shard_result(1, problem="stopped at its time limit after 420 s"),
                   _shard_result(2, gpu_skipped=3)), ("tests/test_z.py: pytest could not "
                                                       "collect it",))
    assert not bad.trusted
    assert bad.lines()[1:] == [
        "  1 problem in the run folders:", "    smoke: env.json: no idle power (x)",
        "  1 test failed:", "    tests/test_0.py::test_y",
        "  3 problems running the tests:",
        "    tests/test_z.py: pytest could not collect it",
        "    shard 1 (cores 2,3): stopped at its time limit after 420 s (log shard1.log)",
        "    3 GPU tests skipped: torch in the tests saw no GPU"]
    assert not Verdict((), 0, (), ("no test collected",)).trusted
    tests_only = Verdict((), 0, (_shard_result(0),))  # --no-sweeps
    assert tests_only.lines() == ["verdict: TRUST this box's figures (checked the test suite "
                                  "with the GPU visible (20 passed, 0 failed, 1 skipped, in 1 "
                                  "shard))"]


def test_the_command_runs_sweeps_then_tests_and_prints_one_verdict(gpu_check, tmp_path,
                                                                  monkeypatch, capsys):
    measured = {n: _as_measured(EVIDENCE / r, tmp_path / n)
                for n, r in (("smoke", "smoke-1gpu"), ("slots", "smoke-2slots"))}
    monkeypatch.setattr(sweeps, "gpus_visible", lambda: 1)
    monkeypatch.setattr(sweeps, "run_check_sweep", lambda name, out, repo: (measured[name], ""))
    calls = []

    def fake_suite(repo, out, cores, per_shard, timeout_s):
        calls.append((out, per_shard, timeout_s))
        return [_shard_result(0), _shard_result(1, failed=("tests/test_1.py::test_q",))], ()

    monkeypatch.setattr(testsuite, "run_suite", fake_suite)
    assert gpu_check.main(["--out", str(tmp_path / "out"), "--shard-timeout-s", "300"]) == 1
    out = capsys.readouterr().out
    assert out.count("verdict: ") == 1
    assert "DO NOT TRUST" in out and "  1 test failed:\n    tests/test_1.py::test_q" in out
    assert "(checked 2 run folders; the test suite" in out
    assert calls == [(tmp_path / "out" / "tests", 2, 300.0)]
    monkeypatch.setattr(testsuite, "run_suite", lambda *a: ([_shard_result(0)], ()))
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 0
    assert "verdict: TRUST" in capsys.readouterr().out
    monkeypatch.setattr(sweeps, "run_check_sweep", lambda name, out, repo: (None, "no folder"))
    assert gpu_check.main(["--out", str(tmp_path / "out"), "--no-tests"]) == 2


# --- two GPUs: the pre-flight, every strategy's two-GPU test, a sweep of every strategy ---

def _fake_two_gpu_box(monkeypatch, visible_gpus, preflight_error: str = "") -> list:
    """A box of two GPUs as gpu_check and the rig's detection see it; the pre-flight's
    calls recorded (and failing with ``preflight_error`` where given)."""
    from bench_lib.measure import preflight

    visible_gpus(2)
    monkeypatch.setattr(sweeps, "gpus_visible", lambda: 2)
    calls = []

    def fake_check(rig, quiet=False):
        calls.append(rig)
        if preflight_error:
            raise preflight.PreflightError(preflight_error)
        return []

    monkeypatch.setattr(preflight, "check", fake_check)
    return calls


def test_the_two_gpu_plan_holds_every_strategys_test_and_sweep_within_15_minutes():
    from bench_lib import strategies
    from bench_lib.prediction.duration import case_seconds, run_estimate
    from bench_lib.prediction.fixed_costs import CUDA
    from bench_lib.sweep.expansion import expand

    planned = plan.two_gpu_plan(CUDA)
    rig = Rig("cuda", 2)
    names = sorted(strategies.REGISTRY)
    assert planned.tests == len(names)
    assert planned.tests_s == pytest.approx(
        CUDA.run_s + sum(case_seconds(plan.tiny_case(n, rig), rig) for n in names))
    args = build_parser().parse_args(sweeps.sweep_command("two-gpus", Path("o"),
                                                          planned.sweep_flags)[3:])
    assert args.strategies == tuple(names) and (args.rig, args.devices) == ("cuda", 2)
    profile = load_profile(profile_path(args.profile_flag, "cuda")).override(
        strategies=args.strategies, split_sizes=args.split_sizes, microbatches=())
    assert profile.rig_figures  # what folders.check asks of the sweep's folder
    cases = expand(profile, rig)
    assert {c.strategy for c in cases if c.status is None} == set(names)
    assert planned.sweep_s == pytest.approx(
        run_estimate(cases, rig, True, profile.predict_time).total_s)
    assert planned.total_s == pytest.approx(planned.preflight_s + planned.tests_s
                                            + planned.sweep_s)
    assert planned.fits and planned.total_s <= 15 * 60, planned.lines()
    total = format_duration(planned.total_s)
    assert planned.lines()[0] == (f"plan on two GPUs: ~{total} estimated, within its "
                                  "15.0 min budget")


def test_over_its_budget_the_sweep_measures_fewer_splits_never_fewer_strategies():
    from bench_lib.prediction.fixed_costs import CUDA

    full = plan.two_gpu_plan(CUDA)
    assert full.sweep_flags[-1] == "2,4"
    cut = plan.two_gpu_plan(CUDA, budget_s=full.total_s - 1)
    assert cut.sweep_flags[-1] == "4" and cut.fits
    assert cut.sweep_cases < full.sweep_cases and cut.sweep_s < full.sweep_s
    assert cut.sweep_flags[:-1] == full.sweep_flags[:-1]  # the same strategies
    over = plan.two_gpu_plan(CUDA, budget_s=60.0)
    assert not over.fits and "OVER its 60 s budget" in over.lines()[0]


def test_its_help_states_the_two_gpu_estimate_from_the_plan(gpu_check, capsys):
    with pytest.raises(SystemExit) as stop:
        gpu_check.parse(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "within 15\nminutes by its own estimate" in out
    assert "\n".join(gpu_check.two_gpu_plan(gpu_check.DEFAULT_OUT).lines()) in out


def test_on_two_gpus_it_runs_the_preflight_the_two_gpu_tests_and_a_sweep_then_one_verdict(
        gpu_check, tmp_path, monkeypatch, capsys, visible_gpus):
    calls = _fake_two_gpu_box(monkeypatch, visible_gpus)
    measured = _as_measured(EVIDENCE / "smoke-1gpu", tmp_path / "two")
    sweeps_run, shards_run = [], []

    def fake_sweep(name, out, repo, flags=None):
        sweeps_run.append((name, flags))
        return measured, ""

    def fake_shards(shards, collection, repo, out, timeout_s):
        shards_run.append((shards, timeout_s))
        shard = shards[0]
        return [ShardResult(shard, 0, 60.0, out / "shard0.log", passed=13)]

    monkeypatch.setattr(sweeps, "run_check_sweep", fake_sweep)
    monkeypatch.setattr(testsuite, "run_shards", fake_shards)
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    planned = gpu_check.two_gpu_plan(tmp_path / "out")
    assert out.startswith("\n".join(planned.lines()))
    assert [(r.kind, r.num_devices) for r in calls] == [("cuda", 2)]
    [(shards, timeout_s)] = shards_run
    assert [s.tests for s in shards] == [(plan.TWO_GPU_TEST,)]
    assert timeout_s >= 2 * planned.tests_s
    assert sweeps_run == [("two-gpus", planned.sweep_flags)]
    assert out.count("verdict: ") == 1
    assert ("verdict: TRUST this box's figures (checked the pre-flight; 1 run folder; every "
            "strategy's two-GPU test through the fork server (13 passed, 0 failed") in out


def test_on_two_gpus_a_failed_preflight_or_skipped_tests_is_no_trust(gpu_check, tmp_path,
                                                                      monkeypatch, capsys,
                                                                      visible_gpus):
    _fake_two_gpu_box(monkeypatch, visible_gpus, preflight_error="all_reduce: timed out")
    ran = []
    monkeypatch.setattr(sweeps, "run_check_sweep", lambda *a, **k: ran.append(a))
    monkeypatch.setattr(testsuite, "run_shards", lambda *a, **k: ran.append(a))
    assert gpu_check.main(["--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert ran == []  # nothing after a failed pre-flight
    assert "DO NOT TRUST" in out and "  1 problem in the pre-flight:\n    all_reduce" in out
    # Tests that skipped (torch saw one GPU) are not tests that passed.
    skipped = ShardResult(PytestShard(0, (0,), (plan.TWO_GPU_TEST,), 1.0), 0, 5.0, Path("s.log"),
                          passed=0, skipped=13)
    verdict = Verdict((), 1, (skipped,), tests_label="the two-GPU tests", required_tests=13,
                      preflight="")
    assert not verdict.trusted
    assert verdict.lines()[-1] == ("    0 of the 13 tests required ran (the rest skipped or "
                                   "never started: did torch in the tests see too few GPUs?)")
    assert Verdict((), 1, (_shard_result(0),), required_tests=20, preflight="").trusted
