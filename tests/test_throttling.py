"""Clocks and throttling (#28 item 9): each GPU sample records the SM clock, the temperature
and NVML's clock event reasons; a case whose GPU clocks were held back (power cap, thermal,
sync boost...) in over 10% of its timed window is marked ``throttled``, as contention is."""

from __future__ import annotations

import csv
import types

import pytest

from bench_lib.measure.cpu_sources import ProcessSource
from bench_lib.measure.nvml_source import NvmlSource
from bench_lib.measure.sampler import Sampler
from bench_lib.results.schema import SAMPLE_COLUMNS, SAMPLE_METRIC_NAMES
from bench_lib.results.store import RunWriter
from tests.test_monitor import fake_nvml

POWER_CAP, SYNC_BOOST, HW_THERMAL = 0x4, 0x10, 0x40
IDLE, APP_CLOCKS = 0x1, 0x2


def nvml_with_clocks(masks: dict[int, int], legacy: bool = False) -> types.SimpleNamespace:
    """The sampler tests' fake NVML, with temperatures (60 + GPU) and each GPU's clock
    event reasons (``masks``; NVML before 12.535 names them throttle reasons)."""
    nvml = fake_nvml()
    nvml.NVML_TEMPERATURE_GPU = 0
    nvml.nvmlDeviceGetTemperature = lambda h, sensor: 60 + h if sensor == 0 else None
    name = ("nvmlDeviceGetCurrentClocksThrottleReasons" if legacy
            else "nvmlDeviceGetCurrentClocksEventReasons")
    setattr(nvml, name, lambda h: masks[h])
    return nvml


def test_nvml_samples_record_clock_temperature_and_clock_event_reasons():
    nvml = nvml_with_clocks({0: 0, 1: POWER_CAP | HW_THERMAL})
    source = NvmlSource({"0": 0, "1": 1}, nvml=nvml)
    rows = {r["device"]: r for r in source.read()}
    source.close()
    assert rows["0"]["sm_clock_mhz"] == 1980 and rows["0"]["gpu_temp_c"] == 60
    assert rows["1"]["gpu_temp_c"] == 61
    assert rows["0"]["clock_event_reasons"] == "none"  # read, and nothing held the clocks
    assert rows["1"]["clock_event_reasons"] == "sw_power_cap+hw_thermal_slowdown"
    legacy = NvmlSource({"0": 0}, nvml=nvml_with_clocks({0: IDLE | 0x800}, legacy=True))
    (row,) = legacy.read()
    legacy.close()
    assert row["clock_event_reasons"] == "gpu_idle+0x800"  # an unknown bit keeps its value


def test_unreadable_reasons_and_cpu_samples_leave_the_cells_empty(tmp_path):
    nvml = fake_nvml()  # no temperature, no clock event reasons: an old NVML or driver

    def unsupported(*_):
        raise nvml.NVMLError("not supported")

    nvml.nvmlDeviceGetCurrentClocksEventReasons = unsupported
    (row,) = NvmlSource({"0": 0}, nvml=nvml).read()
    assert row["gpu_temp_c"] is None and row["clock_event_reasons"] is None
    with Sampler([ProcessSource({"0": 1})], interval_s=0.05) as s:
        pass
    assert all(r["clock_event_reasons"] is None and r["gpu_temp_c"] is None for r in s.samples)
    with RunWriter(tmp_path) as w:
        w.write_case({"case_id": "c1", "status": "ok"}, samples=s.samples[:1])
    with (tmp_path / "samples.csv").open(newline="") as f:
        (written,) = list(csv.DictReader(f))
    assert {"gpu_temp_c", "clock_event_reasons"} <= set(SAMPLE_COLUMNS)
    assert written["clock_event_reasons"] == "" and written["gpu_temp_c"] == ""


def test_a_resumed_folder_keeps_its_samples_header(tmp_path):
    old = [c for c in SAMPLE_COLUMNS if c not in ("gpu_temp_c", "clock_event_reasons")]
    (tmp_path / "samples.csv").write_text(",".join(old) + "\n")
    sample = {"time_unix_s": 1.0, "device": "0", **dict.fromkeys(SAMPLE_METRIC_NAMES),
              "gpu_temp_c": 70, "clock_event_reasons": "none"}
    with RunWriter(tmp_path) as w:
        w.write_case({"case_id": "c1", "status": "ok"}, samples=[sample])
    with (tmp_path / "samples.csv").open(newline="") as f:
        header, row = list(csv.reader(f))
    assert header == old and len(row) == len(old)


def _samples(device: str, reasons: list[str], t0: float = 100.0, interval_s: float = 0.1):
    return [{"time_unix_s": t0 + i * interval_s, "device": device,
             **dict.fromkeys(SAMPLE_METRIC_NAMES), "clock_event_reasons": r}
            for i, r in enumerate(reasons)]


def test_a_case_is_throttled_when_a_reason_other_than_idle_held_over_10pct():
    from bench_lib.measure.throttling import throttling

    window = [(100.0, 101.95)]  # 20 samples of each GPU inside it
    quiet = _samples("0", ["gpu_idle", "applications_clocks_setting",
                           "gpu_idle+applications_clocks_setting", "none"] * 5)
    assert throttling(quiet, window) == ""  # idle and application clocks are no throttling
    at_the_line = _samples("1", ["sw_power_cap"] * 2 + ["none"] * 18)  # 10%: not over it
    assert throttling(at_the_line, window) == ""
    capped = _samples("1", ["sw_power_cap"] * 3 + ["sw_power_cap+sync_boost"] * 2
                      + ["none"] * 15)
    outside = _samples("1", ["hw_thermal_slowdown"] * 10, t0=200.0)  # another case's window
    note = throttling(quiet + capped + outside, window)
    assert note.startswith("clocks held back in over 10% of the timed window")
    assert "GPU 1 25% (sw_power_cap 25%, sync_boost 10%)" in note and "GPU 0" not in note
    assert throttling(_samples("1", ["sw_power_cap"] * 2), window) == ""  # too few samples
    cpu = _samples("0", [None] * 20)  # a cpu rig: no reasons read
    assert throttling(cpu, window) == ""


def test_the_case_row_marks_a_throttled_case_as_contention_is_marked():
    from bench_lib.launch.protocol import CaseOutcome
    from bench_lib.rig import Rig
    from bench_lib.rows.rows import case_row
    from bench_lib.sweep.cases import new_case

    rig = Rig("cuda", 1)
    case = new_case(rig, "single", "resnet-tiny", 32, 8)
    hot = _samples("0", ["hw_thermal_slowdown"] * 5 + ["none"] * 15)
    outcome = CaseOutcome("ok", step_times_s=[0.5] * 4, peak_mem_mib={"0": 1.0},
                          peak_mem_net_mib={"0": 1.0}, stop_reason="min_time",
                          timed_window_unix_s=(100.0, 101.95), samples=hot)
    row = case_row(case, rig, outcome)
    assert row["throttled"].endswith("GPU 0 25% (hw_thermal_slowdown 25%)")
    cool = CaseOutcome("ok", step_times_s=[0.5] * 4, peak_mem_mib={"0": 1.0},
                       peak_mem_net_mib={"0": 1.0}, stop_reason="min_time",
                       timed_window_unix_s=(100.0, 101.95), samples=_samples("0", ["none"] * 20))
    assert case_row(case, rig, cool)["throttled"] == ""


def test_compare_names_the_throttled_cases():
    from bench_lib.compare.output import throttled_cases

    run = types.SimpleNamespace(cases={
        "a": {"throttled": "clocks held back ...: GPU 0 25% (sw_power_cap 25%)"},
        "b": {"throttled": ""}, "c": {"throttled": None}})
    assert throttled_cases(run) == ["a (clocks held back ...: GPU 0 25% (sw_power_cap 25%))"]


@pytest.mark.parametrize("mask,names", [(0, "none"), (IDLE, "gpu_idle"),
                                        (APP_CLOCKS | SYNC_BOOST,
                                         "applications_clocks_setting+sync_boost")])
def test_clock_event_names(mask, names):
    from bench_lib.nvml import clock_event_names

    assert clock_event_names(mask) == names
