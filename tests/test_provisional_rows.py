"""The answer early, then sharper (#39 item 4): after each round of a workload its rows so far,
made by the code that makes the final rows, stand provisional at the end of cases.csv; the
final rows replace them; a resume drops them; the answer is printed (and the report written)
after a round."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from bench_lib.launch.protocol import CaseOutcome
from bench_lib.prediction.admission import Admission
from bench_lib.results.read import (
    done_case_ids,
    provisional_round,
    provisional_text,
    provisional_words,
    read_cases,
)
from bench_lib.results.schema import SCHEMA_VERSION
from bench_lib.results.store import RunWriter, prepare_resume, write_json_atomic
from bench_lib.rows.speedup_table import SpeedupTable
from bench_lib.rows.workload_rows import RoundDone, RowInputs, workload_rows
from bench_lib.run import runner
from bench_lib.sweep.cases import new_case
from bench_lib.sweep.profile import Measurement

# Each fake launch's median step, per strategy and round: launches that differ, so that
# intervals and paired speedups have something to say from round 2 on.
MEDIANS_S = {"single": (0.100, 0.110, 0.104), "ddp": (0.060, 0.066, 0.061)}


def _fake_launch(spec, work_root, launch, options) -> CaseOutcome:
    """``run_case`` without processes: a launch's outcome from ``MEDIANS_S``."""
    case = spec.case
    median = MEDIANS_S[case.strategy][launch]
    steps = [median * f for f in (0.98, 1.0, 1.0, 1.03)]
    ranks = range(case.world_size if case.process_group else 1)
    devices = [str(r) for r in range(case.world_size)]
    return CaseOutcome("ok", step_times_s=steps, rank_step_times_s={r: steps for r in ranks},
                       peak_mem_mib=dict.fromkeys(devices, 300.0),
                       peak_mem_net_mib=dict.fromkeys(devices, 120.0),
                       peak_mem_source="vmhwm", warmup_steps=1, warmup_time_s=0.2,
                       wall_time_s=2.0)


def _same(a: dict, b: dict) -> bool:
    """Two rows alike, NaN included (NaN != NaN)."""
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True,
                                                                     default=str)


def _empty(value: object) -> bool:
    return value in ("", None) or (isinstance(value, float) and math.isnan(value))


def _cases_csv(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "cases.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def _run_folder(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_json_atomic(run_dir / "env.json", {"schema_version": SCHEMA_VERSION})
    return run_dir


def test_round_rows_and_final_rows_come_from_one_function(tmp_path, monkeypatch, cpu_rig):
    m = Measurement(warmup_steps=1, timed_steps=4, launches=3)
    cases = [new_case(cpu_rig, s, "resnet-tiny", 32, 4, measurement=m) for s in ("single", "ddp")]
    monkeypatch.setattr(runner, "run_case", _fake_launch)
    admission = Admission.of(cpu_rig, cases)
    launched: dict[int, list[CaseOutcome]] = {0: [], 1: []}
    rounds: list[RoundDone] = []
    files: list[list[dict[str, str]]] = []
    run_dir = _run_folder(tmp_path)

    def round_done(done: RoundDone) -> None:
        rounds.append(done)
        files.append(_cases_csv(run_dir))

    with RunWriter(run_dir) as writer:
        final = runner.run_sweep(cases, cpu_rig, writer, runner.SweepOptions(admission=admission),
                                 runner.SweepCallbacks(
                                     on_launch_done=lambda i, c, r, o: launched[i].append(o),
                                     on_round_done=round_done))

    def made(launches: int) -> list[dict]:
        so_far = {i: outcomes[:launches] for i, outcomes in launched.items()}
        return [row for _, row, _ in workload_rows(RowInputs(cpu_rig, admission), cases,
                                                   [0, 1], so_far, {}, SpeedupTable(), {})]

    assert [(d.round_done, d.rounds, d.final, d.last) for d in rounds] == [
        (1, 3, False, False), (2, 3, False, False), (3, 3, True, True)]
    # The final rows are the function's on every launch; round r's on the first r launches.
    assert all(_same(a, b) for a, b in zip(final, made(3), strict=True))
    for done in rounds[:2]:
        text = provisional_text(done.round_done, 3)
        assert all(_same(a, b | {"provisional": text})
                   for a, b in zip(done.rows, made(done.round_done), strict=True))
    single, ddp = rounds[0].rows
    # After round 1: one launch each, no interval (the interval code gives none for 1).
    assert single["launches"] == ddp["launches"] == 1
    for row in (single, ddp):
        assert _empty(row["step_time_s_ci_low"]) and row["step_time_ci_note"]
    assert _empty(ddp["speedup_ci_low"]) and ddp["speedup_vs_single"] == pytest.approx(
        MEDIANS_S["single"][0] / MEDIANS_S["ddp"][0], rel=0.02)
    assert rounds[1].rows[1]["launches"] == 2 and rounds[1].rows[1]["speedup_ci_low"] > 0
    # cases.csv: the round's rows replaced the last round's, then the final ones replaced them.
    assert [[r["provisional"] for r in f] for f in files] == [
        ["after round 1 of 3"] * 2, ["after round 2 of 3"] * 2, ["", ""]]
    assert [r["launches"] for r in files[-1]] == ["3", "3"]


def _row(case_id: str, strategy: str = "single", median: float = 0.1, **more) -> dict:
    return {"case_id": case_id, "strategy": strategy, "status": "ok",
            "step_time_s_median": median, "throughput_img_s": 4 / median} | more


def _interrupted_run(tmp_path: Path) -> Path:
    """A folder as a run stopped after round 1 of its second workload leaves it."""
    run_dir = _run_folder(tmp_path)
    with RunWriter(run_dir) as w:
        w.write_case(_row("a"), steps=[{"rank": 0, "step": 0, "step_time_s": 0.1}])
        w.write_provisional([_row("b", provisional="after round 1 of 3"),
                             _row("c", "ddp", 0.07, provisional="after round 1 of 3")])
    return run_dir


def test_the_writer_replaces_provisional_rows_each_round_then_finalises(tmp_path):
    run_dir = _run_folder(tmp_path)
    with RunWriter(run_dir) as w:
        w.write_case(_row("a"), steps=[{"rank": 0, "step": 0, "step_time_s": 0.1}])
        w.write_provisional([_row("b", provisional="after round 1 of 2"),
                             _row("c", "ddp", provisional="after round 1 of 2")])
        assert [(r["case_id"], r["provisional"]) for r in _cases_csv(run_dir)] == [
            ("a", ""), ("b", "after round 1 of 2"), ("c", "after round 1 of 2")]
        assert len(read_cases(run_dir)) == 3  # whole rows, no case twice
        w.write_provisional([_row("b", median=0.2, provisional="after round 2 of 2")])
        assert [(r["case_id"], r["step_time_s_median"]) for r in _cases_csv(run_dir)] == [
            ("a", "0.1"), ("b", "0.2")]
        with pytest.raises(ValueError, match="provisional"):
            w.write_provisional([_row("b")])  # a row that does not say it is provisional
        with pytest.raises(ValueError, match="write_provisional"):
            w.write_case(_row("b", provisional="after round 2 of 2"))
        w.write_case(_row("b", median=0.3), steps=[{"rank": 0, "step": 0, "step_time_s": 0.3}])
        w.write_case(_row("c", "ddp"), steps=[{"rank": 0, "step": 0, "step_time_s": 0.1}])
    rows = _cases_csv(run_dir)
    assert [(r["case_id"], r["provisional"], r["step_time_s_median"]) for r in rows] == [
        ("a", "", "0.1"), ("b", "", "0.3"), ("c", "", "0.1")]
    with (run_dir / "steps.csv").open(newline="") as f:
        assert [r["case_id"] for r in csv.DictReader(f)] == ["a", "b", "c"]  # once, final


def test_resume_drops_provisional_rows_and_runs_their_workload_again(tmp_path):
    run_dir = _interrupted_run(tmp_path)
    assert done_case_ids(run_dir) == {"a"}  # what a dry run of --resume reads
    assert prepare_resume(run_dir) == {"a"}
    assert [r["case_id"] for r in _cases_csv(run_dir)] == ["a"]
    with RunWriter(run_dir) as w:  # the resumed run appends after the kept final row
        w.write_provisional([_row("b", provisional="after round 1 of 3")])
        w.write_case(_row("b"))
    assert [(r["case_id"], r["provisional"]) for r in _cases_csv(run_dir)] == [
        ("a", ""), ("b", "")]


def test_a_folder_from_before_the_column_gets_no_provisional_rows(tmp_path):
    run_dir = _run_folder(tmp_path)
    with RunWriter(run_dir) as w:
        w.write_case(_row("a"))
    path = run_dir / "cases.csv"
    rows = _cases_csv(run_dir)
    columns = [c for c in rows[0] if c != "provisional"]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    with RunWriter(run_dir) as w:  # resumed: its header without the column is kept
        w.write_provisional([_row("b", provisional="after round 1 of 3")])
    assert [r["case_id"] for r in _cases_csv(run_dir)] == ["a"]


def test_the_words_of_provisional_rows():
    assert provisional_round("after round 2 of 3") == (2, 3)
    assert provisional_round("") is None and provisional_round(float("nan")) is None
    assert provisional_words(["", None]) == ""
    assert provisional_words(["", "after round 1 of 3"]) == (
        "provisional, after round 1 of 3: one launch per case, no intervals")
    assert provisional_words(["after round 2 of 3"]).startswith(
        "provisional, after round 2 of 3: 2 launches so far")


def test_the_headlines_say_their_rows_are_provisional():
    from bench_lib.report.headlines import headline_lines

    rows = [{"case_id": "single", "strategy": "single", "model": "resnet-tiny",
             "image_size": 32, "batch_size": 4, "precision": "fp32", "status": "ok",
             "step_time_s_median": 0.1, "throughput_img_s": 40.0, "launches": 1,
             "provisional": "after round 1 of 3"}]
    lines = headline_lines(rows)
    assert "Provisional, after round 1 of 3: one launch per case, no intervals." in lines
    assert not any("rovisional" in line for line in headline_lines(
        [rows[0] | {"provisional": ""}]))


def test_the_report_is_due_after_a_workloads_first_round_only():
    from bench_lib.commands.after_run import report_due

    def due(done: int, rounds: int, workload: int = 1, workloads: int = 2) -> bool:
        return report_due(RoundDone((), done, rounds, workload, workloads))

    assert [due(r, 4) for r in (1, 2, 3, 4)] == [True, False, False, False]
    assert due(1, 4, 2, 2) and not due(4, 4, 2, 2)  # the run's end writes the last one
    assert not due(1, 1, 2, 2)  # one round of the last workload: the run's end writes it


@pytest.mark.timeout(300)
@pytest.mark.integration
def test_a_cpu_run_answers_after_its_first_round(shared_run):
    """A real run on the cpu rig (``tests.conftest.SHARED_RUN``: one workload in two rounds,
    with --report): the answer and the report after round 1, provisional rows in cases.csv
    then, the final rows at the end."""
    done, seen = shared_run, shared_run.interim
    assert done.returncode == 0, done.stderr
    err = done.stderr
    assert "workload 1 of 1, after round 1 of 2:" in err
    after_round_1 = err.index("workload 1 of 1, after round 1 of 2:")
    assert "Provisional, after round 1 of 2: one launch per case, no intervals." in err[
        after_round_1:]
    assert err.index("launch 2/2") > after_round_1  # printed between the rounds
    (when, rows, html), = seen  # one interim report: the last round's is the run's own
    assert when == "after round 1 of 2 of workload 1"
    assert {r["provisional"] for r in rows} == {"after round 1 of 2"} and len(rows) == 2
    assert "provisional, after round 1 of 2: one launch per case, no intervals" in html
    run_dir = shared_run.run_dir
    final = _cases_csv(run_dir)
    assert [r["provisional"] for r in final] == ["", ""]
    assert [r["launches"] for r in final] == ["2", "2"]
    assert "rovisional" not in (run_dir / "report.html").read_text()
