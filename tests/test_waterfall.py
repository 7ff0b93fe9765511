"""The waterfall (analysis/waterfall.py) from hand-made parts: each part by its formula, parts
that sum to the step, a large remainder said as such, and what is missing said why."""

from __future__ import annotations

import pytest

from bench_lib.analysis.waterfall import PARTS, busiest_over_mean, waterfall

CURVE = {16: 0.27, 8: 0.35, 4: 0.12, 2: 0.08}
"""single's median step (s) per batch: the full batch 16 and its batch curve."""


def test_ddp_loses_to_its_per_device_batch_and_to_unhidden_communication():
    w = waterfall("ddp", 2, 16, 8, None, CURVE, measured_s=0.40, comm_s=0.02)
    assert isinstance(w, type(w)) and not isinstance(w, str)
    assert w.ideal_s == pytest.approx(0.27 / 2)
    assert w.batch_s == pytest.approx(0.35 - 0.135)  # a rank computes 8: single's step at 8
    assert (w.imbalance_s, w.bubble_s) == (0.0, 0.0)
    assert w.comm_s == 0.02
    assert w.remainder_s == pytest.approx(0.40 - 0.35 - 0.02)


def test_a_pipeline_whose_parts_sum_to_its_step_has_no_remainder():
    # gpipe, 2 devices, 4 micro-batches of 4: a device computes 16 / 4 = 4 micro-batches of
    # half the model: 16 / (4 x 2) x T1(4) = 0.24 s; the busiest does 10% more; GPipe's
    # theory idles (p-1)/(m+p-1) = 1/5 of the span: a quarter of the busy time.
    w = waterfall("gpipe", 2, 16, 4, 4, CURVE, measured_s=0.34, busiest_over_mean=1.1,
                  comm_s=0.01, optimizer_s=0.0)
    assert not isinstance(w, str)
    assert w.batch_s == pytest.approx(0.24 - 0.135)
    assert w.imbalance_s == pytest.approx(0.024)
    assert w.bubble_s == pytest.approx(0.264 / 4)
    assert w.remainder_s == pytest.approx(0.34 - (0.135 + 0.105 + 0.024 + 0.066 + 0.01))
    assert abs(w.remainder_s) < 1e-3
    cols = w.columns()
    assert sum(cols[f"waterfall_{p}_pct"] for p in PARTS) == pytest.approx(100)
    assert cols["waterfall_note"] == ("bubble (p-1)/(m+p-1), p=2 v=1 m=4; "
                                      "busiest device 1.10x the mean")


def test_a_large_remainder_is_reported_not_hidden():
    w = waterfall("1f1b", 2, 16, 4, 4, CURVE, measured_s=0.60)
    assert not isinstance(w, str)
    explained = w.ideal_s + w.batch_s + w.bubble_s
    assert w.remainder_s == pytest.approx(0.60 - explained)
    assert w.columns()["waterfall_remainder_pct"] == pytest.approx(100 * (0.60 - explained)
                                                                     / 0.60)
    assert w.columns()["waterfall_remainder_pct"] > 40


def test_a_serial_case_idles_all_but_one_device():
    # pipeline on a cpu rig: one process runs both stages in turn.
    w = waterfall("pipeline", 2, 16, 4, 4, CURVE, measured_s=0.5, serial=True)
    assert not isinstance(w, str)
    assert w.bubble_s == pytest.approx(0.24)  # (N-1) x its compute
    assert w.note.startswith("serial") and "optimizer step not measured" in w.note


def test_accumulation_on_one_device_loses_only_to_its_micro_batch():
    w = waterfall("accum", 1, 16, 2, 8, CURVE, measured_s=0.7)
    assert not isinstance(w, str)
    assert w.ideal_s == 0.27 and w.batch_s == pytest.approx(8 * 0.08 - 0.27)
    assert w.bubble_s == 0.0 and w.remainder_s == pytest.approx(0.7 - 0.64)


def test_a_missing_point_of_the_curve_is_said():
    assert "batch_curve is off" in waterfall("ddp", 2, 16, 8, None, {16: 0.27}, 0.4)
    assert "batch 32 was not measured" in waterfall("ddp", 2, 32, 16, None, CURVE, 0.4)


def test_busiest_over_mean():
    assert busiest_over_mean({"a": 0.9, "b": 0.6}) == pytest.approx(0.9 / 0.75)
    assert busiest_over_mean({"a": 0.8}) == 1.0 and busiest_over_mean({}) == 1.0


def test_the_optimizer_step_counts_once_per_step_for_the_share_a_device_updates():
    # T1(4) = 0.12 s holds a 0.03 s optimizer step: 4 micro-batches of half the model pay
    # their forward and backward each, the optimizer once, for half the model.
    w = waterfall("gpipe", 2, 16, 4, 4, CURVE, measured_s=0.4, optimizer_s=0.03,
                  optimizer_share=0.5)
    assert not isinstance(w, str)
    assert w.ideal_s + w.batch_s == pytest.approx(16 / (4 * 2) * (0.12 - 0.03) + 0.015)
    # ddp: each rank updates the whole model, once: single's step at 8, as it is.
    d = waterfall("ddp", 2, 16, 8, None, CURVE, measured_s=0.4, optimizer_s=0.03)
    assert not isinstance(d, str)
    assert d.ideal_s + d.batch_s == pytest.approx(0.35)
    unmeasured = waterfall("gpipe", 2, 16, 4, 4, CURVE, measured_s=0.4)
    assert not isinstance(unmeasured, str)
    assert "optimizer step not measured" in unmeasured.note


def test_the_figure_draws_each_case_from_its_ideal_to_its_measured_step():
    import pandas as pd

    from bench_lib.report.waterfall_figure import fig_waterfall

    common = {"run_label": "r", "model": "resnet50", "image_size": 64, "batch_size": 16,
              "precision": "fp32", "status": "ok", "world_size": 2}
    rows = []
    for strategy, split, w in (("ddp", float("nan"),
                                waterfall("ddp", 2, 16, 8, None, CURVE, 0.40, comm_s=0.01)),
                               ("gpipe", 4.0, waterfall("gpipe", 2, 16, 4, 4, CURVE, 0.60))):
        assert not isinstance(w, str)
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
    weak = waterfall("ddp", 2, 32, 16, None, CURVE, 0.30, workload_batch=16)
    assert not isinstance(weak, str)
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
    w = waterfall("ddp", 2, 16, 8, None, CURVE, measured_s=0.47, comm_s=0.07,
                  shared_compute_s=0.40)
    assert not isinstance(w, str)
    assert (w.batch_s, w.corun_s) == pytest.approx((0.35 - 0.135, 0.05))
    assert abs(w.remainder_s) < 1e-9 and "computing together 1.14x alone" in w.note
    assert sum(w.columns()[f"waterfall_{p}_pct"] for p in PARTS) == pytest.approx(100)
    # A pipeline's imbalance and bubble grow from the shared compute, not the lone one.
    p = waterfall("gpipe", 2, 16, 4, 4, CURVE, measured_s=0.5, busiest_over_mean=1.1,
                  optimizer_s=0.0, shared_compute_s=0.30)
    assert not isinstance(p, str)
    assert p.corun_s == pytest.approx(0.30 - 0.24)
    assert p.imbalance_s == pytest.approx(0.03) and p.bubble_s == pytest.approx(0.33 / 4)
    # One process runs the stages in turn: nothing computes side by side.
    serial = waterfall("pipeline", 2, 16, 4, 4, CURVE, measured_s=0.5, serial=True,
                       shared_compute_s=0.30)
    assert not isinstance(serial, str) and serial.corun_s == 0.0


def _timeline(busy: dict[int, float]) -> tuple[dict, ...]:
    """One pass per rank from t=0, ``busy`` seconds long; the span is the longest."""
    return tuple({"rank": r, "device": f"cpu:{r}", "stage": r, "microbatch": 0,
                  "phase": "fwd", "start_s": 0.0, "end_s": b} for r, b in busy.items())


def test_the_shared_compute_comes_from_the_cases_own_steps_without_communication(cpu_rig):
    from bench_lib.run.protocol import CaseOutcome
    from bench_lib.run.rows import shared_compute_s, waterfall_columns
    from bench_lib.sweep.cases import new_case

    ddp = new_case(cpu_rig, "ddp", "resnet50", 64, 16)
    ok = CaseOutcome("ok", compute_step_s=0.41)
    assert shared_compute_s(ddp, ok, 0.48, {}, 0.01, 1.0) == pytest.approx(0.41)
    # fsdp takes ddp's of the same local batch, less the optimizer on what it does not own.
    fsdp = new_case(cpu_rig, "fsdp", "resnet50", 64, 16)
    assert shared_compute_s(fsdp, CaseOutcome("ok"), 0.8, {}, 0.01, 0.5,
                            ddp_compute_s=0.41) == pytest.approx(0.405)
    assert shared_compute_s(fsdp, CaseOutcome("ok"), 0.8, {}, 0.01, 0.5) is None
    # A pipelining schedule: its devices' passes in the traced step, scaled to the median.
    gpipe = new_case(cpu_rig, "gpipe", "resnet50", 64, 16, split_size=4, partition="balanced")
    traced = CaseOutcome("ok", timeline=_timeline({0: 0.4, 1: 0.3}), traced_step_s=0.5)
    idle = {(0, "cpu:0"): 0.0, (1, "cpu:1"): 0.25}
    assert shared_compute_s(gpipe, traced, 0.45, idle, 0.02, 0.5) == pytest.approx(
        0.35 * 0.45 / 0.5 + 0.01)
    mp = new_case(cpu_rig, "mp", "resnet50", 64, 16, partition="balanced")
    assert shared_compute_s(mp, traced, 0.45, idle, 0.02, 0.5) is None  # one process
    # On a cpu rig a data-parallel case's comm is its collectives' whole time.
    row = {"step_time_s_median": 0.48, "bound_comm_s": 0.0, "bound_compute_s": 0.41,
           "step_time_s_bound_no_overlap": 0.49}
    cols = waterfall_columns(ddp, cpu_rig, ok, row, {16: 0.3, 8: 0.35})
    assert cols["waterfall_comm_s"] == pytest.approx(0.08)
    assert cols["waterfall_corun_s"] == pytest.approx(0.41 - 0.35)
    assert cols["waterfall_remainder_s"] == pytest.approx(0.48 - 0.41 - 0.08)


def test_a_serial_case_runs_every_device_s_compute_in_turn():
    # One process, two stages, the busiest 1.2x the mean: the step is both stages' compute
    # one after the other (2 x 0.24 s), whatever the split between them.
    w = waterfall("pipeline", 2, 16, 4, 4, CURVE, measured_s=0.48, serial=True,
                  busiest_over_mean=1.2, optimizer_s=0.0)
    assert not isinstance(w, str)
    assert w.imbalance_s == pytest.approx(0.048)
    assert w.bubble_s == pytest.approx(0.48 - 0.288)  # the busiest idles while the other runs
    assert abs(w.remainder_s) < 1e-9


def test_a_large_remainder_names_what_is_missing():
    fsdp = waterfall("fsdp", 2, 16, 8, None, CURVE, measured_s=0.6, comm_s=0.1)
    assert not isinstance(fsdp, str)
    assert fsdp.remainder_s / 0.6 > 0.1
    assert "remainder +25% of the step: no part covers FSDP2's work around its" in fsdp.note
    over = waterfall("ddp", 2, 16, 8, None, CURVE, measured_s=0.3)
    assert not isinstance(over, str)
    assert "remainder -17% of the step: the parts add up to more than the step" in over.note
    small = waterfall("ddp", 2, 16, 8, None, CURVE, measured_s=0.37)
    assert not isinstance(small, str) and "remainder" not in small.note
