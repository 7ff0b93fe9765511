"""One model of a step: the waterfall (measured), the bound and the prediction read each
shared part from the same function (``analysis.step_parts``, ``analysis.bound.replay_schedule``),
and the predicted parts add up to the predicted step.

Each test builds a case from hand-made figures (a calibration, collective fits, a traced
step), replaces one part's function by a stub with a value no formula would give, and checks
that all three columns carry that value: a column that priced the part its own way would not.
"""

from __future__ import annotations

import pytest

from bench_lib.analysis import bound, step_parts
from bench_lib.analysis.collective_fits import CollectiveFit, Collectives
from bench_lib.launch.protocol import CaseOutcome
from bench_lib.prediction.calibration_data import BatchCosts, Calibration
from bench_lib.prediction.case_shape import shape_of
from bench_lib.prediction.step_time import predict_case, predicted_parts
from bench_lib.rig import Rig
from bench_lib.rows import case_bound, waterfall
from bench_lib.sweep.cases import new_case
from tests.test_bound import traced

OPT = 0.01
FIT = CollectiveFit((1,), (1.0,), alpha_s=0.002, beta_bytes_s=1e8, busbw_gb_s=1.0)
COLL = Collectives({op: FIT for op in ("all_reduce", "all_gather", "reduce_scatter",
                                       "send_recv")}, "gloo", 2)
BLOCKS = (0.01, 0.012, 0.01, 0.011, 0.009, 0.008)  # resnet-tiny's 6 blocks, forward


def calibration() -> Calibration:
    at = {b: BatchCosts(0.02 * b + 0.05) for b in (2, 8, 16, 32)}
    together = {b: BatchCosts(1.1 * c.step_s, BLOCKS, tuple(2 * f for f in BLOCKS))
                for b, c in at.items()}
    return Calibration(OPT, at, together, 2, copies={step_parts.FRESH_COPY_BYTES: 0.02})


def columns(case, rig, outcome, median, cal):
    """(prediction, its parts, the bound, the waterfall's columns) of one case."""
    predicted = predict_case(case, rig, cal, COLL)
    assert not isinstance(predicted, str), predicted
    parts = predicted_parts(shape_of(case, rig), cal, predicted)
    assert not isinstance(parts, str), parts
    curve = {b: c.step_s for b, c in cal.alone.items()}
    found = case_bound.case_bound(case, rig, outcome, median, curve[case.workload_batch],
                                  COLL, ddp_compute_s=0.4, copies=cal.copies)
    assert isinstance(found, bound.Bound), found
    water = waterfall.waterfall_columns(case, rig, outcome, {"step_time_s_median": median},
                                         curve, OPT, found, ddp_compute_s=0.4)
    return predicted, parts, found, water


@pytest.fixture(params=["cpu", "cuda"])
def rig(request, cpu_rig):
    return cpu_rig if request.param == "cpu" else Rig("cuda", 2, 1, ())


def test_fsdp_copies_come_from_one_function(rig, monkeypatch):
    case = new_case(rig, "fsdp", "resnet-tiny", 32, 32)
    calls = []

    def copies(units, root, devices, rate):
        calls.append(devices)
        return 0.123

    monkeypatch.setattr(step_parts, "fsdp_copies_s", copies)
    predicted, parts, found, water = columns(case, rig, CaseOutcome("ok", step_times_s=[1.0]),
                                             1.0, calibration())
    assert predicted.other_s == parts.own_s == found.other_s == 0.123
    assert water["waterfall_own_s"] == 0.123
    assert calls == [2, 2]  # the prediction's and the bound's (the waterfall reads the bound)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_exposed_communication_comes_from_one_function(rig, strategy, monkeypatch):
    case = new_case(rig, strategy, "resnet-tiny", 32, 32)
    seen = []

    def exposed(compute_s, comm_s, overlap):
        seen.append(overlap)
        return 0.0777

    monkeypatch.setattr(step_parts, "exposed_comm_s", exposed)
    outcome = CaseOutcome("ok", step_times_s=[1.0], compute_step_s=0.4)
    predicted, parts, found, water = columns(case, rig, outcome, 1.0, calibration())
    assert predicted.comm_s == parts.comm_s == found.comm_s == 0.0777
    assert water["waterfall_comm_s"] == 0.0777
    assert seen == [rig.kind == "cuda"] * 2  # overlapped on GPUs only, in both


def test_a_schedules_bubble_comes_from_one_replay(cpu_rig, monkeypatch):
    """The prediction replays calibrated passes, the bound (and so the waterfall) the traced
    ones: through the same ``replay_schedule``. A stub that says makespan 1.0 s with the ranks busy
    0.6 and 0.7 s gives every column the bubble 1.0 - 0.7."""
    case = new_case(cpu_rig, "1f1b", "resnet-tiny", 32, 8, split_size=2)
    events = traced([(0, 0, 2, 4), (1, 1, 1, 2)], 4, 0.01)
    span = max(e["end_s"] for e in events)
    outcome = CaseOutcome("ok", step_times_s=[span], timeline=events, traced_step_s=span,
                          partition="balanced:3")
    monkeypatch.setattr(bound, "replay_schedule",
                        lambda orders, times, edge_s=(): (1.0, [0.6, 0.7]))
    predicted, parts, found, water = columns(case, cpu_rig, outcome, span, calibration())
    assert predicted.bubble_s == parts.bubble_s == found.bubble_s == pytest.approx(0.3)
    assert water["waterfall_bubble_s"] == pytest.approx(0.3)
    assert parts.imbalance_s == pytest.approx(0.05)  # 0.7 - mean(0.6, 0.7)


CASES = [("single", {}), ("ddp", {}), ("ddp-1", {}), ("fsdp", {}), ("mp", {}),
         ("accum", {"split_size": 8}), ("pipeline", {"split_size": 8}),
         ("gpipe", {"split_size": 8}), ("1f1b", {"split_size": 2})]


@pytest.mark.parametrize(("strategy", "options"), CASES[1:])
def test_the_predicted_parts_add_up_to_the_predicted_step(rig, strategy, options):
    case = new_case(rig, strategy, "resnet-tiny", 32, 32, **options)
    if case.status is not None:
        pytest.skip(f"{strategy} on a {rig.kind} rig: {case.reason}")
    cal = calibration()
    predicted = predict_case(case, rig, cal, COLL)
    assert not isinstance(predicted, str), predicted
    parts = predicted_parts(shape_of(case, rig), cal, predicted)
    assert not isinstance(parts, str), parts
    assert parts.total_s == pytest.approx(predicted.step_s)
    assert parts.ideal_s == pytest.approx(cal.alone[32].step_s / case.world_size)


def test_ddp_own_work_is_measured_from_a_ddp1_case_and_said_where_there_is_none(cpu_rig):
    from bench_lib.rows.workload_rows import ddp_own_s

    ddp = new_case(cpu_rig, "ddp", "resnet-tiny", 32, 32)
    ddp1 = new_case(cpu_rig, "ddp-1", "resnet-tiny", 32, 32)
    one = CaseOutcome("ok", step_times_s=[0.55, 0.57, 0.56])
    assert ddp_own_s(ddp, [(ddp1, one)], {32: 0.50}) == pytest.approx(0.06)
    assert ddp_own_s(ddp, [], {32: 0.50}) is None
    outcome = CaseOutcome("ok", step_times_s=[0.4], compute_step_s=0.3)
    water = waterfall.waterfall_columns(ddp, cpu_rig, outcome, {"step_time_s_median": 0.4},
                                         {32: 0.5, 16: 0.3}, OPT, None)
    assert water["waterfall_own_s"] == 0.0 and waterfall.NO_DDP1 in water["waterfall_note"]
    water = waterfall.waterfall_columns(ddp, cpu_rig, outcome, {"step_time_s_median": 0.4},
                                         {32: 0.5, 16: 0.3}, OPT, None, ddp_own_s=0.06)
    assert water["waterfall_own_s"] == 0.06


def test_a_ddp_case_on_one_device_measures_its_own_work_from_its_no_sync_steps(cpu_rig):
    """The H100's smoke run: ddp on one GPU, 29.0 ms a step, 22.3 ms in no_sync, single 20.4
    ms: DDP's own work 6.7 ms, and 1.9 ms (its no_sync steps over single's) remain."""
    case = new_case(cpu_rig, "ddp-1", "resnet-tiny", 32, 8)
    outcome = CaseOutcome("ok", step_times_s=[0.029], compute_step_s=0.0223)
    water = waterfall.waterfall_columns(case, cpu_rig, outcome, {"step_time_s_median": 0.029},
                                         {8: 0.0204}, None, None)
    assert water["waterfall_own_s"] == pytest.approx(0.0067)
    assert water["waterfall_remainder_s"] == pytest.approx(0.0223 - 0.0204)
