"""Contention is visible: per-step CPU time beside wall time, the machine's steal and other
processes' CPU over a case, the row's ``contention`` flag, and compare's note on it."""

from __future__ import annotations

import csv
import os
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench_lib.commands import main
from bench_lib.launch.protocol import CaseOutcome, CaseSpec, RankResult
from bench_lib.measure.contention import (
    CPU_PER_WALL_MIN,
    OTHER_CPU_PCT_MAX,
    STEAL_PCT_MAX,
    CpuSnapshot,
    MachineLoad,
    contention,
    cpu_per_wall,
    machine_load,
)
from bench_lib.results.read import read_steps
from bench_lib.results.schema import CASE_COLUMNS
from bench_lib.results.store import RunWriter
from bench_lib.rig import Rig
from bench_lib.rows.rows import case_row, contention_columns, step_rows
from bench_lib.run.case_launch import LaunchOptions, run_case
from bench_lib.sweep.cases import Case, new_case
from bench_lib.sweep.profile import Measurement
from tests.test_compare import make_run

# ---- the arithmetic, on fake cpu_times ---------------------------------------------------


def cpu_times(busy: float = 0.0, idle: float = 0.0, steal: float = 0.0, **extra: float):
    """A psutil.cpu_times()-like record (seconds summed over CPUs); busy is all user."""
    fields = dict(user=busy, nice=0.0, system=0.0, idle=idle, iowait=0.0, irq=0.0,
                  softirq=0.0, steal=steal, guest=0.0, guest_nice=0.0)
    return SimpleNamespace(**(fields | extra))


def test_snapshot_sums_busy_fields_and_capacity_and_leaves_guest_out():
    snap = CpuSnapshot.of(cpu_times(busy=10, idle=5, steal=1, nice=2, system=3, irq=0.5,
                                    softirq=0.25, iowait=4, guest=7), children_s=1, own_s=2)
    assert snap.machine_busy_s == pytest.approx(10 + 2 + 3 + 0.5 + 0.25)
    assert snap.machine_steal_s == 1
    # guest is already inside user on Linux: counting it again would inflate capacity.
    assert snap.machine_total_s == pytest.approx(15.75 + 5 + 4 + 1)


def test_other_cpu_is_busy_minus_the_cases_and_the_runners_over_capacity():
    # 2 CPUs over 10 s = 20 CPU-s. Busy 12 CPU-s: the ranks 6, the runner 1, others 5.
    start = CpuSnapshot.of(cpu_times(busy=100, idle=100, steal=3), children_s=50, own_s=7)
    end = CpuSnapshot.of(cpu_times(busy=112, idle=107, steal=4), children_s=56, own_s=8)
    load = machine_load(start, end)
    assert load is not None
    assert load.other_cpu_pct == pytest.approx(100 * 5 / 20)
    assert load.cpu_steal_pct == pytest.approx(100 * 1 / 20)


def test_machine_load_clamps_tick_rounding_and_needs_capacity():
    start = CpuSnapshot.of(cpu_times(busy=10, idle=10), children_s=0, own_s=0)
    # The process clocks saw a little more than the 10 ms ticks of /proc/stat did.
    end = CpuSnapshot.of(cpu_times(busy=11, idle=11), children_s=1.02, own_s=0.01)
    load = machine_load(start, end)
    assert load is not None and load.other_cpu_pct == 0.0
    assert machine_load(start, start) is None


def test_cpu_per_wall_is_the_median_ratio_over_pinned_cores():
    assert cpu_per_wall([0.1, 0.05, 0.1], [0.1, 0.1, 0.1], 1) == pytest.approx(1.0)
    assert cpu_per_wall([0.1, 0.1, 0.1], [0.1, 0.1, 0.1], 2) == pytest.approx(0.5)
    assert cpu_per_wall([], [], 1) is None


def test_contention_reasons_and_thresholds():
    quiet = MachineLoad(cpu_steal_pct=1.0, other_cpu_pct=OTHER_CPU_PCT_MAX)
    assert contention(quiet, ratio=CPU_PER_WALL_MIN) == ""
    assert contention(None) == ""
    busy = MachineLoad(cpu_steal_pct=0.0, other_cpu_pct=38.2)
    assert contention(busy) == "other processes used 38% of the machine's CPU during the case"
    stolen = MachineLoad(cpu_steal_pct=STEAL_PCT_MAX + 2, other_cpu_pct=0.0)
    assert contention(stolen).startswith("steal 12%")
    waited = contention(quiet, ratio=0.5, cores=2)
    assert "50% of its 2 pinned cores x wall time" in waited and "waited for a core" in waited


# ---- the row and steps.csv columns -------------------------------------------------------


def fake_outcome(cpu: list[float], wall: list[float], load: MachineLoad | None,
                 ranks: int = 1) -> CaseOutcome:
    return CaseOutcome("ok", step_times_s=wall, rank_step_times_s={r: wall for r in range(ranks)},
                       rank_step_cpu_times_s={r: cpu for r in range(ranks)},
                       peak_mem_mib={"0": 1.0}, stop_reason="step_cap", machine_load=load)


def tiny(rig: Rig, strategy: str = "single", steps: int = 2) -> Case:
    m = Measurement(warmup_steps=2, timed_steps=steps, max_time_s=60, case_timeout_s=180,
                    interval_target_pct=0)
    return new_case(rig, strategy, "resnet-tiny", 32, 4, split_size=2, measurement=m)


def test_row_flags_a_single_process_case_that_waited_but_not_a_distributed_one(cpu_rig):
    quiet = MachineLoad(0.0, 1.0)
    half = fake_outcome([0.05, 0.05, 0.05], [0.1, 0.1, 0.1], quiet)
    row = case_row(tiny(cpu_rig), cpu_rig, half)
    assert row["other_cpu_pct"] == 1.0 and row["cpu_steal_pct"] == 0.0
    assert "50% of its 1 pinned core x wall time" in row["contention"]
    # ddp ranks wait on each other by design: the same ratio does not flag them.
    ddp = case_row(tiny(cpu_rig, "ddp"), cpu_rig, fake_outcome([0.05] * 3, [0.1] * 3, quiet, 2))
    assert ddp["contention"] == ""
    full = fake_outcome([0.1, 0.1, 0.1], [0.1, 0.1, 0.1], MachineLoad(0.0, 40.0))
    assert "other processes used 40%" in case_row(tiny(cpu_rig), cpu_rig, full)["contention"]
    # A case that never ran has nothing to say.
    assert contention_columns(tiny(cpu_rig), cpu_rig, CaseOutcome("skipped", "no")) == {}
    assert {"cpu_steal_pct", "other_cpu_pct", "contention"} <= set(CASE_COLUMNS)


def test_steps_rows_carry_cpu_time_and_rank_results_keep_it(tmp_path):
    out = fake_outcome([0.09, 0.08], [0.1, 0.1], None, ranks=2)
    assert step_rows(out)[3] == {"launch": 0, "rank": 1, "step": 1, "step_time_s": 0.1,
                                 "cpu_time_s": 0.08, "probe_s": ""}  # no probe ran
    # Launches keep their own step indices, and say which launch each step is of.
    two = CaseOutcome.of_launches([out, fake_outcome([0.07], [0.2], None, ranks=2)])
    assert [(r["launch"], r["rank"], r["step"]) for r in step_rows(two)][4:] == [(1, 0, 0),
                                                                                (1, 1, 0)]
    result = RankResult(0, "ok", step_times_s=(0.1, 0.2), step_cpu_times_s=(0.09, 0.19))
    result.write(tmp_path / "rank0.json")
    assert RankResult.read(tmp_path / "rank0.json") == result


# ---- real cases through the runner -------------------------------------------------------


def per_step_ratios(outcome: CaseOutcome, cores: int) -> list[float]:
    cpu, wall = outcome.rank_step_cpu_times_s[0], outcome.rank_step_times_s[0]
    assert len(cpu) == len(wall) > 0
    return [c / (cores * w) for c, w in zip(cpu, wall)]


@pytest.mark.timeout(180)
@pytest.mark.integration
def test_cpu_time_per_step_is_recorded_and_plausible(cpu_rig, tmp_path, forks):
    case = tiny(cpu_rig, steps=10)
    outcome = run_case(CaseSpec(case, cpu_rig), tmp_path / "work",
                       options=LaunchOptions(server=forks))
    assert outcome.status == "ok", outcome.reason
    # A process pinned to T cores spends (0, T x wall] of CPU per step (+ clock granularity).
    for c, w in zip(outcome.rank_step_cpu_times_s[0], outcome.rank_step_times_s[0]):
        assert 0 < c <= cpu_rig.threads_per_worker * w * 1.05 + 1e-3
    row = case_row(case, cpu_rig, outcome)
    # This machine may be shared with other tests: only check the figures are consistent.
    assert 0 <= row["other_cpu_pct"] <= 100 and 0 <= row["cpu_steal_pct"] <= 100
    assert isinstance(row["contention"], str)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with RunWriter(run_dir) as w:
        w.write_case(row, step_rows(outcome))
    steps = read_steps(run_dir)
    assert steps["cpu_time_s"].tolist() == pytest.approx(outcome.rank_step_cpu_times_s[0])


@pytest.mark.timeout(240)
@pytest.mark.integration
def test_a_hog_on_the_cases_core_is_flagged(cpu_rig, tmp_path, capsys, forks):
    """A busy loop pinned to the core of the case's worker: the case gets about half of it.

    Its steps double smoothly (the spread rule would not see it); the runner sees the hog's
    CPU as other processes' and the worker's CPU time per step falls to ~50% of its wall.
    """
    case = tiny(cpu_rig, steps=100)  # ~3 s of timed steps alone, ~6 s beside the hog
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(hog.pid, cpu_rig.cores_of(0))
        outcome = run_case(CaseSpec(case, cpu_rig), tmp_path, options=LaunchOptions(server=forks))
    finally:
        hog.kill()
        hog.wait()
    assert outcome.status == "ok", outcome.reason
    row = case_row(case, cpu_rig, outcome)
    ratio = statistics.median(per_step_ratios(outcome, cpu_rig.threads_per_worker))
    with capsys.disabled():
        print(f"\nhogged single: other_cpu_pct {row['other_cpu_pct']}, cpu_steal_pct "
              f"{row['cpu_steal_pct']}, median CPU/wall {ratio:.2f}, step "
              f"{row['step_time_s_median'] * 1000:.1f} ms, case {row['case_wall_time_s']} s; "
              f"contention: {row['contention']}")
    # The hog alone is half a core of a machine of len(cores): over 10% on up to 4 CPUs.
    assert row["other_cpu_pct"] > OTHER_CPU_PCT_MAX and row["other_cpu_pct"] <= 100
    assert ratio < CPU_PER_WALL_MIN
    assert "other processes used" in row["contention"]
    assert "waited for a core" in row["contention"]


# ---- compare's note ----------------------------------------------------------------------


def mark_contention(run_dir: Path, strategy: str, reason: str) -> str:
    """Give one case of a hand-made run folder a contention reason; returns its case_id."""
    path = run_dir / "cases.csv"
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    (hit,) = [r for r in rows if r["strategy"] == strategy]
    hit["contention"] = reason
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return hit["case_id"]


def test_compare_notes_cases_measured_under_contention(tmp_path, capsys):
    base = make_run(tmp_path, "base", 1)
    cand = make_run(tmp_path, "cand", 2)
    reason = "other processes used 38% of the machine's CPU during the case"
    case_id = mark_contention(cand, "single", reason)
    main(["compare", str(base), str(cand), "--markdown", str(tmp_path / "gate.md")])
    out = capsys.readouterr().out
    assert f"candidate was measured under contention: {case_id} ({reason})" in out
    assert "baseline was measured under contention" not in out
    assert case_id in (tmp_path / "gate.md").read_text()
    main(["compare", str(base), str(make_run(tmp_path, "quiet", 3))])
    assert "under contention" not in capsys.readouterr().out
