"""The step's parts (``analysis.step_parts``), each on its own, by hand."""

from __future__ import annotations

import pytest

from bench_lib.analysis import step_parts
from bench_lib.analysis.step_parts import PARTS, Figures, parts
from bench_lib.results.schema import CASES

OPT = 0.02  # the optimizer step alone, seconds
CURVE = {16: 0.60, 8: 0.34, 4: 0.20}  # single's step per batch, seconds


def test_ideal_batch_and_optimizer_add_up_to_one_devices_compute():
    """ddp over 2 devices at batch 16: each computes 8 images at once and steps the whole
    model. ideal 0.60/2 = 0.30; batch 16/16 x (0.34-0.02) - 16/32 x (0.60-0.02) = 0.03;
    optimizer 1 x 0.02 - 16/32 x 0.02 = 0.01; their sum is C = 0.32 + 0.02 = 0.34."""
    f = Figures(2, 16, 8, 16, CURVE, OPT, 1.0)
    found = parts(f)
    assert not isinstance(found, str)
    assert (found.ideal_s, found.batch_s, found.optimizer_s) == pytest.approx((0.30, 0.03, 0.01))
    assert found.ideal_s + found.batch_s + found.optimizer_s == pytest.approx(
        step_parts.curve_compute_s(f))
    assert found.corun_s == found.imbalance_s == found.bubble_s == 0.0


def test_a_split_model_steps_its_share_of_the_optimizer():
    """A pipeline of 2 stages, micro-batches of 4 out of 16: C = 16/8 x (0.20-0.02) + 0.02/2
    = 0.37; the optimizer part is 0 (each device steps exactly its half, as the ideal's
    0.60 / 2 counts it)."""
    found = parts(Figures(2, 16, 4, 16, CURVE, OPT, 0.5))
    assert not isinstance(found, str)
    assert found.optimizer_s == pytest.approx(0.0)
    assert found.ideal_s + found.batch_s == pytest.approx(0.37)


def test_weak_scaling_starts_from_single_at_the_devices_batch():
    """Weak: 2 devices x 8 images, compared with single at 8: ideal = T(8), batch 0."""
    found = parts(Figures(2, 16, 8, 8, CURVE, OPT, 1.0))
    assert not isinstance(found, str)
    assert found.ideal_s == pytest.approx(0.34)
    assert found.batch_s == pytest.approx(0.0) and found.optimizer_s == pytest.approx(0.0)


def test_corun_imbalance_bubble_comm_and_own_are_the_figures_given():
    f = Figures(2, 16, 8, 16, CURVE, OPT, 1.0, shared_compute_s=0.40, busy_s=(0.30, 0.40),
                bubble_s=0.05, comm_s=0.07, own_s=0.02, own_what="x")
    found = parts(f)
    assert not isinstance(found, str)
    assert found.corun_s == pytest.approx(0.40 - 0.34)
    assert found.imbalance_s == pytest.approx(0.05)  # 0.40 - mean(0.30, 0.40)
    assert (found.bubble_s, found.comm_s, found.own_s, found.own_what) == (0.05, 0.07, 0.02, "x")
    assert found.total_s == pytest.approx(0.40 + 0.05 + 0.05 + 0.07 + 0.02)


def test_a_serial_step_is_every_pass_in_turn_plus_the_optimizer():
    """mp over 2 devices, batch 16 (one micro-batch): traced passes 0.35 and 0.30 s, gaps
    0.01 s. The parts add up to the passes + OPT + gaps; what the passes take beyond single's
    curve (C = 0.30 each) is the serial process's own work."""
    f = Figures(2, 16, 16, 16, CURVE, OPT, 0.5, serial=True, busy_s=(0.35, 0.30), own_s=0.01)
    found = parts(f)
    assert not isinstance(found, str)
    assert found.total_s == pytest.approx(0.35 + 0.30 + OPT + 0.01)
    assert found.corun_s == 0.0
    assert found.own_s == pytest.approx((0.325 + 0.01) - 0.30 + 0.01)
    assert found.bubble_s == pytest.approx(0.30 + OPT / 2)  # the other device's passes + share


def test_a_serial_step_without_a_trace_is_n_times_one_devices_compute():
    found = parts(Figures(2, 16, 16, 16, CURVE, OPT, 0.5, serial=True))
    assert not isinstance(found, str)
    assert found.total_s == pytest.approx(CURVE[16])
    assert found.bubble_s == pytest.approx(CURVE[16] / 2) and found.own_s == 0.0


def test_a_batch_the_curve_lacks_is_said():
    assert parts(Figures(2, 16, 2, 16, CURVE, OPT, 1.0)) == "single's step at batch 2 is not known"


def test_exposed_communication_overlaps_on_gpus_only():
    assert step_parts.exposed_comm_s(0.3, 0.1, overlap=True) == 0.0
    assert step_parts.exposed_comm_s(0.3, 0.5, overlap=True) == pytest.approx(0.2)
    assert step_parts.exposed_comm_s(0.3, 0.1, overlap=False) == 0.1


def test_fsdp_copies_by_hand():
    """Two units of 4 MiB and a root of 2 MiB on 2 devices: 3 x (4 + 2) x 2 + 2 x (2 + 1)
    = 42 MiB, at 1 GB/s."""
    mib = 2**20
    assert step_parts.fsdp_copied_bytes([4 * mib, 4 * mib], 2 * mib, 2) == 42 * mib
    rate = {step_parts.FRESH_COPY_BYTES: step_parts.FRESH_COPY_BYTES / 1e9}
    assert step_parts.fsdp_copies_s([4 * mib, 4 * mib], 2 * mib, 2, rate) == pytest.approx(
        42 * mib / 1e9)
    with pytest.raises(KeyError):
        step_parts.fsdp_copies_s([mib], 0, 2, {})


def test_ddp_own_work_is_the_step_with_ddp_less_the_step_without():
    assert step_parts.ddp_own_s(0.029, 0.0223) == pytest.approx(0.0067)
    assert step_parts.ddp_own_s(0.50, 0.51) == pytest.approx(-0.01)  # noise stays visible


def ev(rank, stage, mb, phase, start, end):
    return {"rank": rank, "device": f"cpu:{rank}", "stage": stage, "microbatch": mb,
            "phase": phase, "start_s": start, "end_s": end}


def test_schedule_work_counts_the_gaps_a_rank_did_not_wait_for():
    """Two stages on two ranks, two micro-batches. Rank 0: F0 [0, 1], F1 [1.1, 2.1] (its
    input is the batch: 0.1 of own work), B0 [3.5, 4.5] (its gradient came from rank 1 at
    3.4: 0.1 of own work, 1.4 of waiting), B1 [5.5, 6] (gradient at 5.45: 0.05). Rank 1:
    F0 [1.2, 2] (input at 1: 0.2 after it, but its first pass has no previous one: not
    counted), B0 [2.3, 3.4] (after its own F0: 0.3), F1 [3.6, 4.4] (F1 of stage 0 ended at
    2.1, rank 1 free at 3.4: 0.2), B1 [4.4, 5.45] (0)."""
    events = [ev(0, 0, 0, "fwd", 0, 1), ev(0, 0, 1, "fwd", 1.1, 2.1),
              ev(0, 0, 0, "bwd", 3.5, 4.5), ev(0, 0, 1, "bwd", 5.5, 6),
              ev(1, 1, 0, "fwd", 1.2, 2), ev(1, 1, 0, "bwd", 2.3, 3.4),
              ev(1, 1, 1, "fwd", 3.6, 4.4), ev(1, 1, 1, "bwd", 4.4, 5.45)]
    assert step_parts.schedule_work_s(events) == pytest.approx(max(0.1 + 0.1 + 0.05,
                                                                   0.3 + 0.2))
    assert step_parts.schedule_work_s([]) == 0.0


def test_a_serial_process_counts_every_gap_between_its_passes():
    """One rank runs both stages in turn: every gap is its own work."""
    events = [ev(0, 0, 0, "fwd", 0, 1), ev(0, 1, 0, "fwd", 1.05, 2),
              ev(0, 1, 0, "bwd", 2.02, 3), ev(0, 0, 0, "bwd", 3.1, 4)]
    assert step_parts.schedule_work_s(events) == pytest.approx(0.05 + 0.02 + 0.1)


def test_imbalance_ignores_idle_devices_and_one_device():
    assert step_parts.imbalance_s([0.3, 0.5]) == pytest.approx(0.1)
    assert step_parts.imbalance_s([0.3]) == 0.0 and step_parts.imbalance_s([0.3, 0.0]) == 0.0


def test_every_part_has_its_measured_and_predicted_columns_documented():
    names = {c.name for c in CASES}
    for part in PARTS:
        assert {f"waterfall_{part}_s", f"waterfall_{part}_pct", f"predicted_{part}_s"} <= names
