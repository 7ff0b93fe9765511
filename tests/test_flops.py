"""FLOP counts by hand, the measured peak, and the MFU / speedup columns."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch import nn

from bench_lib.launch.protocol import CaseOutcome
from bench_lib.measure import flop_peak, flop_probe, flops
from bench_lib.rows.rows import derived_columns, efficiency
from bench_lib.rows.speedup_table import SpeedupTable
from bench_lib.sweep.cases import new_case


def test_count_train_flops_of_linear_layers_by_hand():
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    net = nn.Sequential(nn.Linear(4, 6, bias=False), nn.ReLU(), nn.Linear(6, 3, bias=False))
    # forward: 2*5*4*6 + 2*5*6*3 = 420; backward: second layer's weight and input gradients
    # (180 each), first layer's weight gradient only (240: the input needs no gradient).
    assert flops.count_train_flops(net, x, y, nn.functional.mse_loss) == 420 + 600


def test_train_flops_per_image_scales_with_pixels_and_is_cached():
    flops.train_flops_per_image.cache_clear()
    small = flops.train_flops_per_image("resnet-tiny", 32)
    large = flops.train_flops_per_image("resnet-tiny", 64)
    # Convolutions scale with the pixel count (4x); only the small classifier head does not.
    assert 3.9 < large / small < 4.0
    flops.train_flops_per_image("resnet-tiny", 32)
    assert flops.train_flops_per_image.cache_info().hits == 1


def test_efficiency_hand_computed():
    achieved, mfu = efficiency(2e9, 500.0, peak_tflop_s=4.0)
    assert achieved == pytest.approx(1.0) and mfu == pytest.approx(25.0)
    assert efficiency(2e9, 500.0, None) == (pytest.approx(1.0), None)


TINY_CONV = flop_probe.ConvShape(1, 8, 8)


@pytest.mark.integration
def test_peak_is_measured_per_device_in_a_pinned_subprocess(cpu_rig):
    peak = flop_peak.measure_peak(cpu_rig, ["fp32"], n=128, min_time_s=0.02, conv=TINY_CONV)
    assert set(peak.tflop_s["fp32"]) == {"0", "1"} and peak.matmul_n == 128
    assert all(0 < v < 100 for v in peak.tflop_s["fp32"].values())
    for dev, best in peak.tflop_s["fp32"].items():  # the best of the GEMM and conv probes
        figures = peak.by_probe["fp32"][dev]
        assert set(figures) == set(flop_probe.PROBES) and best == max(figures.values())
        assert figures[peak.probe["fp32"][dev]] == best
    assert flop_peak.AttainablePeak.from_dict(peak.as_dict()) == peak
    here = flop_probe.measure_here(cpu_rig, ["fp32"], n=64, min_time_s=0.01, conv=TINY_CONV)
    assert all(math.isfinite(v) and v > 0 for v in here["fp32"].values())


def _outcome(times, mem):
    # The imbalance ratio is of the net figures; the gross ones carry a runtime beside them.
    gross = {k: v + 1000 for k, v in mem.items()}
    return CaseOutcome("ok", step_times_s=times, peak_mem_mib=gross, peak_mem_net_mib=mem,
                       stop_reason="ci_target")


def _columns(case, outcome, peak):
    return derived_columns(case, outcome, case.batch_size / statistics.median(outcome.step_times_s),
                           peak)


def test_derived_columns_mfu_over_the_devices_used(cpu_rig):
    case = new_case(cpu_rig, "ddp", "resnet-tiny", 32, 8)
    peak = flop_peak.AttainablePeak({"fp32": {"0": 0.5, "1": 0.3}})
    cols = _columns(case, _outcome([0.1, 0.1, 0.1], {"0": 300, "1": 400}), peak)
    per_img = flops.train_flops_per_image("resnet-tiny", 32)
    achieved = per_img * 80 / 1e12  # 8 images per 0.1 s
    assert cols["achieved_tflop_s"] == pytest.approx(achieved)
    assert cols["mfu_pct"] == pytest.approx(100 * achieved / 0.8)
    assert cols["mem_imbalance_ratio"] == pytest.approx(400 / 300)
    assert cols["stop_reason"] == "ci_target"
    single = new_case(cpu_rig, "single", "resnet-tiny", 32, 8)
    cols = _columns(single, _outcome([0.1], {"0": 300}), flop_peak.AttainablePeak(unsupported="x"))
    assert cols["mfu_pct"] is None and cols["mem_imbalance_ratio"] == 1.0


def test_speedup_relative_to_single_of_the_same_workload(cpu_rig):
    table = SpeedupTable()
    mk = lambda s, b=8: new_case(cpu_rig, s, "resnet-tiny", 32, b)  # noqa: E731
    # Launch medians per round: round 2 ran 10% slower for both (drift), which pairing cancels.
    single = {"status": "ok", "launch_medians_s": "0.3;0.33;0.3"}
    ddp = {"status": "ok", "launch_medians_s": "0.2;0.22;0.2"}
    other = {"status": "ok", "launch_medians_s": "0.2;0.2;0.2"}
    for case, row in ((mk("single"), single), (mk("ddp"), ddp), (mk("ddp", 16), other)):
        table.fill(case, row)
    assert single["speedup_vs_single"] == pytest.approx(1.0)
    assert ddp["speedup_vs_single"] == pytest.approx(1.5)
    assert ddp["scaling_efficiency"] == pytest.approx(0.75)
    assert ddp["speedup_ci_low"] == pytest.approx(1.5) == ddp["speedup_ci_high"]
    assert ddp["speedup_ci_note"] == ""
    assert "speedup_vs_single" not in other  # no single case of batch 16 in this run
    # Unpaired, the same medians would give an interval: the drift is not in the speedup.
    one = {"status": "ok", "launch_medians_s": "0.25"}
    table.fill(mk("ddp"), one)
    assert one["speedup_vs_single"] == pytest.approx(1.2)  # round 1 only
    assert one["speedup_ci_low"] is None and "rounds measured: 1" in one["speedup_ci_note"]


def test_speedup_table_learns_single_rows_of_a_resumed_run(tmp_path, cpu_rig):
    from bench_lib.results.store import RunWriter

    with RunWriter(tmp_path) as w:
        w.write_case({"case_id": "s", "strategy": "single", "model": "resnet-tiny",
                      "image_size": 32, "batch_size": 8, "precision": "fp32", "loss": "ce",
                      "status": "ok", "launch_medians_s": "0.16;0.15"})
    table = SpeedupTable()
    table.seed(tmp_path / "cases.csv")
    row = {"status": "ok", "launch_medians_s": "0.08;0.1"}
    table.fill(new_case(cpu_rig, "ddp", "resnet-tiny", 32, 8), row)
    assert row["speedup_vs_single"] == pytest.approx(math.sqrt(2 * 1.5))
    assert row["scaling_efficiency"] == pytest.approx(math.sqrt(3) / 2)
