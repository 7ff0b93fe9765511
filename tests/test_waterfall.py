"""The waterfall (rows/waterfall.py): a measured step cut into the step's parts
(analysis/step_parts.py) from hand-made figures, each part by its formula, parts that sum to
the step, a large remainder said as such, what is missing said why; and the measured figures
read off a case (rows/waterfall.py)."""

from __future__ import annotations

from typing import Any

import pytest

from bench_lib.analysis.bound import data_parallel_bound
from bench_lib.analysis.step_parts import Figures, imbalance_s
from bench_lib.rows.waterfall import PARTS, SERIAL_NOTE, Waterfall, waterfall

CURVE = {16: 0.27, 8: 0.35, 4: 0.12, 2: 0.08}
"""single's median step (s) per batch: the full batch 16 and its batch curve."""


def made(devices: int, device_batch: int, measured_s: float, batch: int = 16,
         workload_batch: int = 16, **more: Any) -> Waterfall:
    """The waterfall of a case of ``batch`` on ``devices`` from ``CURVE``; never a why."""
    w = waterfall(Figures(devices, batch, device_batch, workload_batch, CURVE, **more),
                  measured_s)
    assert isinstance(w, Waterfall), w
    return w


def test_ddp_loses_to_its_per_device_batch_and_to_unhidden_communication():
    w = made(2, 8, 0.40, comm_s=0.02)
    assert w.parts.ideal_s == pytest.approx(0.27 / 2)
    assert w.parts.batch_s == pytest.approx(0.35 - 0.135)  # a rank computes 8: T1(8)
    assert (w.parts.imbalance_s, w.parts.bubble_s, w.parts.corun_s) == (0.0, 0.0, 0.0)
    assert w.parts.comm_s == 0.02
    assert w.remainder_s == pytest.approx(0.40 - 0.35 - 0.02)


def test_a_pipeline_whose_parts_sum_to_its_step_has_no_remainder():
    # gpipe, 2 devices, 4 micro-batches of 4: a device computes 16 / 4 = 4 micro-batches of
    # half the model: 16 / (4 x 2) x T1(4) = 0.24 s; the busiest does 0.264, 10% more than
    # the mean; GPipe idles (p-1)/(m+p-1) = 1/5 of the span: a quarter of its busy time.
    w = made(2, 4, 0.34, busy_s=(0.264, 0.216), shared_compute_s=0.24, bubble_s=0.264 / 4,
             comm_s=0.01)
    assert w.parts.batch_s == pytest.approx(0.24 - 0.135)
    assert w.parts.corun_s == pytest.approx(0.0)
    assert w.parts.imbalance_s == pytest.approx(0.024)
    assert w.remainder_s == pytest.approx(0.34 - (0.135 + 0.105 + 0.024 + 0.066 + 0.01))
    assert abs(w.remainder_s) < 1e-9
    cols = w.columns()
    assert set(cols) == {f"waterfall_{p}_{u}" for p in PARTS for u in ("s", "pct")} | {
        "waterfall_note"}
    assert sum(cols[f"waterfall_{p}_pct"] for p in PARTS) == pytest.approx(100)
    assert cols["waterfall_note"] == ""  # nothing to say: every part known, nothing left


def test_imbalance_is_the_busiest_device_over_the_mean_one_in_seconds():
    assert imbalance_s((0.9, 0.6)) == pytest.approx(0.9 - 0.75)
    assert imbalance_s((0.3, 0.3, 0.6)) == pytest.approx(0.6 - 0.4)
    assert imbalance_s((0.8,)) == 0.0 and imbalance_s(()) == 0.0
    assert imbalance_s((0.8, 0.0)) == 0.0  # a device with no traced pass is not a device
    # In the waterfall: from the devices' passes, whatever their shared compute.
    w = made(2, 4, 0.5, busy_s=(0.33, 0.27), shared_compute_s=0.30)
    assert w.parts.imbalance_s == pytest.approx(0.03)
    assert made(2, 4, 0.5).parts.imbalance_s == 0.0  # not traced: all alike


def test_a_large_remainder_is_reported_not_hidden():
    # 1f1b, p=2, m=4: ideal 0.135 + batch 0.105 + the bound's bubble 0.06 = 0.30 s.
    w = made(2, 4, 0.60, bubble_s=0.06)
    explained = w.parts.ideal_s + w.parts.batch_s + w.parts.bubble_s
    assert explained == pytest.approx(0.30)
    assert w.remainder_s == pytest.approx(0.60 - explained)
    assert w.columns()["waterfall_remainder_pct"] == pytest.approx(100 * 0.30 / 0.60)
    assert "remainder +50% of the step: work no part covers" in w.note


def test_a_serial_case_idles_all_but_one_device():
    # pipeline on a cpu rig, not traced: one process runs both stages in turn, each
    # device's compute 16 / (4 x 2) x T1(4) = 0.24 s; the busiest idles (N-1) x 0.24.
    w = made(2, 4, 0.5, serial=True)
    assert w.parts.bubble_s == pytest.approx(0.24)
    assert (w.parts.corun_s, w.parts.own_s) == (0.0, 0.0)


def test_a_serial_case_runs_every_device_s_compute_in_turn():
    # One process, two stages, the busiest 1.2x the mean: the step is both stages' compute
    # one after the other (2 x 0.24 s), whatever the split between them.
    w = made(2, 4, 0.48, serial=True, busy_s=(0.288, 0.192))
    assert w.parts.imbalance_s == pytest.approx(0.048)
    assert w.parts.bubble_s == pytest.approx(0.192)  # the busiest idles while the other runs
    assert w.parts.own_s == pytest.approx(0.0)  # the stages took what single's curve says
    assert abs(w.remainder_s) < 1e-9
    # Stages slower than single's curve (mean 0.25 s against 0.24): the 0.01 s is the
    # serial process's own (its hand-offs), beside the work between passes it is given.
    slow = made(2, 4, 0.51, serial=True, busy_s=(0.30, 0.20), own_s=0.01)
    assert slow.parts.own_s == pytest.approx(0.01 + 0.01)
    assert (slow.parts.imbalance_s, slow.parts.bubble_s) == pytest.approx((0.05, 0.20))
    assert abs(slow.remainder_s) < 1e-9  # 0.135 + 0.105 + 0.05 + 0.20 + 0.02 = 0.51
    # One process runs the stages in turn: nothing computes side by side.
    assert made(2, 4, 0.5, serial=True, shared_compute_s=0.30).parts.corun_s == 0.0


def test_accumulation_on_one_device_loses_only_to_its_micro_batch():
    w = made(1, 2, 0.7)
    assert w.parts.ideal_s == 0.27 and w.parts.batch_s == pytest.approx(8 * 0.08 - 0.27)
    assert w.parts.bubble_s == 0.0 and w.remainder_s == pytest.approx(0.7 - 0.64)


def test_a_missing_point_of_the_curve_is_said():
    assert waterfall(Figures(2, 16, 8, 16, {16: 0.27}), 0.4) == (
        "no waterfall: single's step at batch 8 is not known")
    assert waterfall(Figures(2, 32, 16, 32, CURVE), 0.4) == (
        "no waterfall: single's step at batch 32 is not known")


def test_the_optimizer_step_counts_once_per_step_for_the_share_a_device_updates():
    # T1(4) = 0.12 s holds a 0.03 s optimizer step: 4 micro-batches of half the model pay
    # their forward and backward each, the optimizer once, for half the model.
    w = made(2, 4, 0.4, optimizer_s=0.03, optimizer_share=0.5)
    p = w.parts
    assert p.ideal_s + p.batch_s + p.optimizer_s == pytest.approx(
        16 / (4 * 2) * (0.12 - 0.03) + 0.015)
    assert p.optimizer_s == pytest.approx(0.0)  # half the model: its share of the ideal's
    # ddp: each rank updates the whole model, once: single's step at 8, as it is; half of
    # that optimizer step is beyond the ideal's share (0.03 x (1 - 16 / 32)).
    d = made(2, 8, 0.4, optimizer_s=0.03).parts
    assert d.ideal_s + d.batch_s + d.optimizer_s == pytest.approx(0.35)
    assert d.optimizer_s == pytest.approx(0.015)


def test_the_figure_draws_each_case_from_its_ideal_to_its_measured_step():
    import pandas as pd

    from bench_lib.report.waterfall_figure import fig_waterfall

    common = {"run_label": "r", "model": "resnet50", "image_size": 64, "batch_size": 16,
              "precision": "fp32", "status": "ok", "world_size": 2}
    rows = []
    for strategy, split, w in (("ddp", float("nan"), made(2, 8, 0.40, comm_s=0.01)),
                               ("gpipe", 4.0, made(2, 4, 0.60))):
        rows.append(common | {"strategy": strategy, "split_size": split,
                              "step_time_s_median": w.measured_s} | w.columns())
    fig = fig_waterfall(pd.DataFrame(rows))
    assert fig is not None
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["ddp", "gpipe s4"]
    texts = [t.get_text() for t in ax.texts]
    assert texts[0] == "0.68x of single (ideal 2x); unexplained +10%"  # 0.27 / 0.40
    assert texts[1].startswith("0.45x of single (ideal 2x)")  # 0.27 / 0.60
    assert fig_waterfall(pd.DataFrame([common | {"strategy": "single"}])) is None
    # A weak case (16 per device: batch 32 on 2) gets a panel of its own, after the strong.
    weak = made(2, 16, 0.30, batch=32)
    rows.append(common | {"strategy": "ddp", "split_size": float("nan"), "batch_size": 32,
                          "scaling": "weak", "step_time_s_median": 0.30} | weak.columns())
    both = fig_waterfall(pd.DataFrame(rows).fillna({"scaling": "strong"}))
    assert both is not None
    assert [ax.get_title() for ax in both.axes[:2]] == [
        "resnet50 · 64 px · batch 16 · fp32", "resnet50 · 64 px · batch 32 · fp32 · weak: 16 "
        "per device"]


def test_devices_computing_side_by_side_is_a_part_of_its_own():
    # ddp's ranks computed 0.40 s a step together under no_sync, 0.35 s alone (the curve at
    # 8): 0.05 s is what they cost each other; the rest of the step is communication.
    w = made(2, 8, 0.47, comm_s=0.07, shared_compute_s=0.40)
    assert (w.parts.batch_s, w.parts.corun_s) == pytest.approx((0.35 - 0.135, 0.05))
    assert abs(w.remainder_s) < 1e-9
    assert sum(w.columns()[f"waterfall_{p}_pct"] for p in PARTS) == pytest.approx(100)
    # A pipeline's S is its devices' mean passes: 0.30 against 0.24 from single's curve.
    p = made(2, 4, 0.5, busy_s=(0.33, 0.27), shared_compute_s=0.30)
    assert p.parts.corun_s == pytest.approx(0.30 - 0.24)


def test_the_note_gathers_the_figures_notes_the_own_part_and_a_large_remainder():
    # fsdp: ideal 0.135 + batch 0.215 + comm 0.1 = 0.45 of a 0.6 s step: +25% left.
    fsdp = made(2, 8, 0.6, comm_s=0.1)
    assert fsdp.remainder_s / 0.6 == pytest.approx(0.25)
    assert fsdp.note == "remainder +25% of the step: work no part covers"
    # Its copies priced as its own work explain the rest: the note says what they are.
    copies = made(2, 8, 0.6, comm_s=0.1, own_s=0.15, own_what="FSDP2's copies",
                  notes=("a figure's note",))
    assert abs(copies.remainder_s) < 1e-9
    assert copies.note == "a figure's note; FSDP2's copies"
    over = made(2, 8, 0.3)
    assert "remainder -17% of the step: the parts add up to more than the step" in over.note
    small = made(2, 8, 0.37)  # +5%: within UNEXPLAINED
    assert "remainder" not in small.note


def _timeline(busy: dict[int, float]) -> tuple[dict, ...]:
    """One pass per rank from t=0, ``busy`` seconds long; the span is the longest."""
    return tuple({"rank": r, "device": f"cpu:{r}", "stage": r, "microbatch": 0,
                  "phase": "fwd", "start_s": 0.0, "end_s": b} for r, b in busy.items())


def test_the_shared_compute_comes_from_the_cases_own_steps_without_communication(cpu_rig):
    from bench_lib.launch.protocol import CaseOutcome
    from bench_lib.rows.waterfall import measured_figures
    from bench_lib.sweep.cases import new_case

    curve = {16: 0.3, 8: 0.35, 4: 0.1}
    ddp = new_case(cpu_rig, "ddp", "resnet50", 64, 16)
    ok = CaseOutcome("ok", compute_step_s=0.41)
    figures = measured_figures(ddp, cpu_rig, ok, 0.48, curve, 0.01, None)
    assert figures.shared_compute_s == pytest.approx(0.41)
    # fsdp takes ddp's of the same local batch, less the optimizer on what it does not own.
    fsdp = new_case(cpu_rig, "fsdp", "resnet50", 64, 16)
    assert measured_figures(fsdp, cpu_rig, CaseOutcome("ok"), 0.8, curve, 0.01, None,
                            ddp_compute_s=0.41).shared_compute_s == pytest.approx(0.405)
    assert measured_figures(fsdp, cpu_rig, CaseOutcome("ok"), 0.8, curve, 0.01,
                            None).shared_compute_s is None
    # A pipelining schedule: its devices' passes in the traced step, scaled to the median
    # (x 0.45 / 0.5): 0.36 and 0.27, their mean plus its optimizer share 0.02 / 2.
    gpipe = new_case(cpu_rig, "gpipe", "resnet50", 64, 16, split_size=4, partition="balanced")
    traced = CaseOutcome("ok", timeline=_timeline({0: 0.4, 1: 0.3}), traced_step_s=0.5)
    piped = measured_figures(gpipe, cpu_rig, traced, 0.45, curve, 0.02, None)
    assert piped.busy_s == pytest.approx((0.36, 0.27))
    assert piped.shared_compute_s == pytest.approx(0.35 * 0.45 / 0.5 + 0.01)
    mp = new_case(cpu_rig, "mp", "resnet50", 64, 16, partition="balanced")
    serial = measured_figures(mp, cpu_rig, traced, 0.45, curve, 0.02, None)
    assert serial.serial and serial.shared_compute_s is None  # one process
    assert serial.notes[0].startswith(SERIAL_NOTE)


def test_the_waterfall_columns_take_comm_and_own_work_from_the_case_s_bound(cpu_rig):
    from bench_lib.launch.protocol import CaseOutcome
    from bench_lib.rows.waterfall import NO_DDP1, waterfall_columns
    from bench_lib.sweep.cases import new_case

    curve = {16: 0.3, 8: 0.35}
    ddp = new_case(cpu_rig, "ddp", "resnet50", 64, 16)
    ok = CaseOutcome("ok", compute_step_s=0.41)
    row = {"step_time_s_median": 0.48}
    # A cpu rig's bound: compute 0.41 + collectives 0.08, none hidden.
    found = data_parallel_bound("ddp", 0.41, 0.08, overlap=False)
    cols = waterfall_columns(ddp, cpu_rig, ok, row, curve, found=found)
    assert cols["waterfall_comm_s"] == pytest.approx(0.08)
    assert cols["waterfall_corun_s"] == pytest.approx(0.41 - 0.35)
    assert cols["waterfall_remainder_s"] == pytest.approx(0.48 - 0.41 - 0.08)
    assert NO_DDP1 in cols["waterfall_note"]
    # DDP's own work from the run's ddp-1 against single, taken off the remainder.
    own = waterfall_columns(ddp, cpu_rig, ok, row, curve, found=found, ddp_own_s=0.02)
    assert own["waterfall_own_s"] == 0.02
    assert own["waterfall_remainder_s"] == pytest.approx(0.48 - 0.41 - 0.08 - 0.02)
    # fsdp's own work is its bound's copies.
    fsdp = new_case(cpu_rig, "fsdp", "resnet50", 64, 16)
    copies = data_parallel_bound("fsdp", 0.41, 0.08, overlap=False, other_s=0.05)
    cols = waterfall_columns(fsdp, cpu_rig, CaseOutcome("ok"), row, curve, found=copies)
    assert cols["waterfall_own_s"] == 0.05
    assert "FSDP2's copies at the calibrated copy rate" in cols["waterfall_note"]
    # Without a bound, the parts it prices are said unknown; single and failures get none.
    why = waterfall_columns(ddp, cpu_rig, ok, row, curve, found="no bound: no fit")
    assert why["waterfall_comm_s"] == 0.0
    assert "bubble, comm and own work unknown (no bound: no fit)" in why["waterfall_note"]
    single = new_case(cpu_rig, "single", "resnet50", 64, 16)
    assert waterfall_columns(single, cpu_rig, ok, row, curve) == {}
    assert waterfall_columns(ddp, cpu_rig, CaseOutcome("error", "boom"), row, curve) == {}
    # A point of single's curve missing: the why, in the note.
    assert waterfall_columns(ddp, cpu_rig, ok, row, {16: 0.3}) == {
        "waterfall_note": "no waterfall: single's step at batch 8 is not known"}


def test_a_serial_pipeline_without_an_optimizer_step_says_so(cpu_rig):
    from bench_lib.launch.protocol import CaseOutcome
    from bench_lib.rows.waterfall import waterfall_columns
    from bench_lib.sweep.cases import new_case

    pipe = new_case(cpu_rig, "pipeline", "resnet50", 64, 16, split_size=4)
    cols = waterfall_columns(pipe, cpu_rig, CaseOutcome("ok"), {"step_time_s_median": 0.5},
                             CURVE)
    note = str(cols["waterfall_note"])
    assert note.startswith("optimizer step not measured: counted with every micro-batch")
    assert SERIAL_NOTE in note
    assert cols["waterfall_bubble_s"] == pytest.approx(0.24)  # not traced: (N-1) x 0.24
