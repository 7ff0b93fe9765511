"""DDP's compute-only steps run in every launch of a run (#41): ``CaseOutcome.compute_step_s``
is their median over launches, not one launch's few steps. Tune's short launches run none,
and the traced step stays the first launch's."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench_lib.launch import diagnostics, worker
from bench_lib.launch.protocol import CaseOutcome, CaseSpec, RankResult
from bench_lib.nodes.coordination import Coordinator, LaunchNotice
from bench_lib.results.store import RunWriter, write_json_atomic
from bench_lib.rig import Rig
from bench_lib.run import case_launch, runner
from bench_lib.strategies import Trainer
from bench_lib.sweep.cases import new_case
from bench_lib.sweep.profile import Measurement

RIG = Rig("cpu", 2, 1, (0, 1))
QUICK = Measurement(launches=3, warmup_steps=1, timed_steps=2, max_time_s=30,
                    case_timeout_s=120)


@pytest.mark.integration
def test_every_launch_of_a_run_times_the_compute_only_steps_and_only_the_first_traces(
        tmp_path, monkeypatch):
    """The runner asks each launch of a ddp case for its compute-only steps; a later launch
    that stopped asking would leave the median resting on the first launch alone. (The
    rows are not this test's: ``workload_rows`` is a stub that keeps what it was given.)"""
    asked: list[dict[str, Any]] = []
    given: list[list[CaseOutcome]] = []

    def fake_run_case(spec, work_root, launch, options):
        asked.append(vars(spec))
        return CaseOutcome("ok", step_times_s=[1.0, 1.0],
                           compute_step_s=0.5 if spec.compute_only else None)

    def rows(inputs, cases, group, launched, *rest):
        given.append(list(launched[group[0]]))
        return []

    monkeypatch.setattr(runner, "run_case", fake_run_case)
    monkeypatch.setattr(runner, "workload_rows", rows)
    case = new_case(RIG, "ddp", "toy", 0, 8, measurement=QUICK)
    run_dir = tmp_path / "20260101T000000Z_host_abcdef0"
    run_dir.mkdir()
    write_json_atomic(run_dir / "env.json", {"schema_version": 5})
    with RunWriter(run_dir) as writer:
        runner.run_sweep([case], RIG, writer)
    assert [a["compute_only"] for a in asked] == [True, True, True]
    assert [a["trace"] for a in asked] == [True, False, False]
    assert [o.compute_step_s for o in given[-1]] == [0.5, 0.5, 0.5]  # the final rows' input


def test_a_measurement_without_diagnostics_asks_no_launch_for_them(tmp_path, monkeypatch):
    """The ci profile's gates compare step times: no launch of theirs is asked for the
    compute-only or traced steps, and the run's estimate counts none."""
    from bench_lib.prediction.duration import diagnostic_steps

    asked: list[dict[str, Any]] = []

    def fake_run_case(spec, work_root, launch, options):
        asked.append(vars(spec))
        return CaseOutcome("ok", step_times_s=[1.0, 1.0])

    monkeypatch.setattr(runner, "run_case", fake_run_case)
    monkeypatch.setattr(runner, "workload_rows", lambda *args: [])
    quiet = dataclasses.replace(QUICK, diagnostics=False)
    cases = [new_case(RIG, s, "toy", 0, 8, split_size=4 if s == "pipeline" else None,
                      measurement=quiet) for s in ("ddp", "pipeline")]
    run_dir = tmp_path / "20260101T000000Z_host_abcdef0"
    run_dir.mkdir()
    write_json_atomic(run_dir / "env.json", {"schema_version": 5})
    with RunWriter(run_dir) as writer:
        runner.run_sweep(cases, RIG, writer)
    assert len(asked) == 6
    assert not any(a["compute_only"] or a["trace"] for a in asked)
    assert [diagnostic_steps(c, 3) for c in cases] == [0, 0]
    assert diagnostic_steps(dataclasses.replace(cases[1], measurement=QUICK), 3) == 1


@pytest.mark.parametrize("value", ["no", 0, 1])
def test_diagnostics_takes_a_boolean_only(value):
    from bench_lib.sweep.profile import Profile, UsageError

    with pytest.raises(UsageError, match="diagnostics must be true or false"):
        Profile.from_dict({"diagnostics": value})


def test_the_case_s_compute_step_is_the_median_over_its_launches():
    """One launch's steps on a busy moment (the 0.9 s) do not decide the case's figure."""
    launches = [CaseOutcome("ok", step_times_s=[1.0], compute_step_s=s)
                for s in (0.9, 0.5, 0.6)]
    assert CaseOutcome.of_launches(launches).compute_step_s == pytest.approx(0.6)


def test_tunes_short_launches_run_no_compute_only_steps(tmp_path, monkeypatch):
    from bench_lib.tune import search as tune_search

    asked: list[dict[str, Any]] = []

    def fake_run_case(spec, work_root, launch, options):
        asked.append(vars(spec))
        return CaseOutcome("ok")

    monkeypatch.setattr(case_launch, "run_case", fake_run_case)
    launch = tune_search._runner_launch(RIG, tmp_path, case_launch.LaunchOptions())
    launch(new_case(RIG, "ddp", "toy", 0, 8, measurement=QUICK), 1, "")
    assert asked and asked[0]["compute_only"] is False and asked[0]["trace"] is False


@pytest.mark.parametrize("trace", [True, False])
def test_the_spec_carries_compute_only_and_an_old_spec_runs_them_where_it_traced(
        tmp_path, trace):
    case = new_case(RIG, "ddp", "toy", 0, 8, measurement=QUICK)
    path = tmp_path / "spec.json"
    for compute_only in (True, False):
        CaseSpec(case, RIG, trace, compute_only=compute_only).write(path)
        assert CaseSpec.read(path).compute_only is compute_only
    data = json.loads(path.read_text())
    del data["compute_only"]  # a spec file written before the field
    path.write_text(json.dumps(data))
    assert CaseSpec.read(path).compute_only is trace


@pytest.mark.parametrize("compute_only", [True, False])
def test_node_0_tells_every_node_whether_to_run_the_compute_only_steps(compute_only):
    """A multi-node launch: the other nodes' ranks do as node 0's (they meet at a barrier
    before those steps), from the notice node 0 publishes (``Coordinator.announce``)."""
    published: dict[str, str] = {}
    node0 = SimpleNamespace(_seq=0, _store=SimpleNamespace(set=published.__setitem__))
    spec = CaseSpec(new_case(RIG, "ddp", "toy", 0, 8, measurement=QUICK), RIG, False,
                    compute_only=compute_only)
    Coordinator.announce(node0, spec, 1)  # type: ignore[arg-type]
    assert LaunchNotice.from_json(published["launch/0"]).compute_only is compute_only


@pytest.mark.usefixtures("restore_math_flags")
@pytest.mark.parametrize("compute_only", [True, False])
def test_a_later_launch_s_rank_runs_the_compute_only_steps_its_spec_asks_for(
        tmp_path: Path, monkeypatch, compute_only):
    """``worker.main`` from a later launch's spec (no trace): the rank times the compute-only
    steps exactly when the spec says so, and its result carries them."""
    calls: list[bool] = []

    def spy(trainer, x, y, process_group):
        calls.append(process_group)
        return 0.125

    monkeypatch.setattr(diagnostics, "compute_only", spy)
    # single has no mode without communication: give it one, so that only the spec decides.
    monkeypatch.setattr(Trainer, "without_communication",
                        lambda self: contextlib.nullcontext())
    monkeypatch.setattr(worker, "die_with_parent", lambda pid: True)
    monkeypatch.setattr(worker, "pin_worker", lambda rig, index: None)  # the test's process
    rig = Rig("cpu", 1, 1, (0,))
    case = new_case(rig, "single", "toy", 0, 8, measurement=QUICK)
    spec = tmp_path / "spec.json"
    CaseSpec(case, rig, trace=False, compute_only=compute_only).write(spec)
    assert worker.main([str(spec), "0"]) == 0
    result = RankResult.read(tmp_path / "rank0.json")
    assert result.status == "ok", result.reason
    assert calls == ([False] if compute_only else [])
    assert result.compute_step_s == (0.125 if compute_only else None)
    assert result.optimizer_step_s is None  # single's optimizer step: the tracing launch's
