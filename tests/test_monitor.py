"""The sampler: NVML through an injected fake module, psutil for real, RAPL on a fake tree."""

from __future__ import annotations

import csv
import subprocess
import sys
import time
import types

import pytest

from bench_lib.launch import sampling
from bench_lib.launch.protocol import CaseSpec
from bench_lib.measure.cpu_sources import ProcessSource, RaplSource
from bench_lib.measure.nvml_source import NvmlSource
from bench_lib.measure.sampler import Sampler
from bench_lib.results.schema import SAMPLE_COLUMNS
from bench_lib.results.schema import SAMPLE_METRIC_NAMES as SAMPLE_METRICS
from bench_lib.results.store import RunWriter
from bench_lib.rig import Rig
from bench_lib.rows.sampler_columns import window_columns
from bench_lib.run import case_launch
from bench_lib.run.case_launch import LaunchOptions
from bench_lib.sweep.cases import new_case
from bench_lib.sweep.profile import Measurement

MIB = 2**20
BUS_IDS = {"00000000:3B:00.0": 0, "00000000:5E:00.0": 1}


class FakeNvmlError(Exception):
    pass


def fake_nvml(gpm: bool = True, power: bool = True) -> types.SimpleNamespace:
    """A stand-in for pynvml with two GPUs whose counters advance on every read."""
    state = {"energy_mj": 1000, "gpm_samples": 0, "freed": 0, "shutdown": False}

    def not_supported(*_):
        raise FakeNvmlError("not supported")

    def energy(h):
        state["energy_mj"] += 500
        return state["energy_mj"] + 10_000 * h

    def gpm_sample_get(h, sample):
        state["gpm_samples"] += 1
        return sample

    def metrics_get(get):
        for m, value in zip(get.metrics, (71.0, 33.0)):
            m.value, m.nvmlReturn = value, 0
        return get

    def metrics_struct():
        metrics = [types.SimpleNamespace(metricId=None, value=None, nvmlReturn=None)
                   for _ in range(2)]
        return types.SimpleNamespace(version=0, numMetrics=0, sample1=None, sample2=None,
                                     metrics=metrics)

    return types.SimpleNamespace(
        state=state, NVMLError=FakeNvmlError, NVML_SUCCESS=0, NVML_CLOCK_SM=1,
        NVML_GPM_METRICS_GET_VERSION=1, NVML_GPM_METRIC_SM_UTIL=2,
        NVML_GPM_METRIC_ANY_TENSOR_UTIL=5,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: state.update(shutdown=True),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetHandleByPciBusId=lambda bus: BUS_IDS[bus],
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=90 + h, memory=40),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=(1024 + h) * MIB),
        nvmlDeviceGetPowerUsage=(lambda h: 250_000) if power else not_supported,
        nvmlDeviceGetClockInfo=lambda h, kind: 1980 if kind == 1 else None,
        nvmlDeviceGetTotalEnergyConsumption=energy,
        nvmlGpmQueryDeviceSupport=lambda h: types.SimpleNamespace(isSupportedDevice=int(gpm)),
        nvmlGpmSampleAlloc=lambda: object(),
        nvmlGpmSampleGet=gpm_sample_get,
        nvmlGpmSampleFree=lambda s: state.update(freed=state["freed"] + 1),
        nvmlGpmMetricsGet=metrics_get,
        c_nvmlGpmMetricsGet_t=metrics_struct,
    )


def test_nvml_source_converts_units_and_reads_gpm_between_samples():
    nvml = fake_nvml()
    source = NvmlSource({"0": "00000000:3B:00.0", "1": 1}, nvml=nvml)
    first = {r["device"]: r for r in source.read()}
    assert first["0"]["util_gpu_pct"] == 90.0 and first["1"]["util_gpu_pct"] == 91.0
    assert first["1"]["mem_used_mib"] == 1025.0
    assert first["0"]["power_w"] == 250.0  # NVML gives milliwatts
    assert first["0"]["sm_clock_mhz"] == 1980
    assert first["0"]["energy_j"] == 1.5  # 1500 mJ
    # GPM metrics compare two samples: the one taken on opening and the one of this read.
    assert first["0"]["sm_util_pct"] == 71.0 and first["0"]["tensor_active_pct"] == 33.0
    source.close()
    assert nvml.state["shutdown"] and nvml.state["freed"] == 4  # 2 swapped out + 2 at close


def test_nvml_missing_metrics_are_empty_not_zero():
    source = NvmlSource({"0": 0}, nvml=fake_nvml(gpm=False, power=False))
    (row,) = source.read()
    assert row["power_w"] is None
    assert "sm_util_pct" not in row  # the sampler fills absent metrics with None
    with Sampler([source], interval_s=0.05) as s:
        pass
    assert all(r["sm_util_pct"] is None and r["power_w"] is None for r in s.samples)
    assert all(r["util_gpu_pct"] == 90.0 for r in s.samples)


def test_case_sampler_on_a_cuda_rig_uses_nvml_by_bus_id(monkeypatch):
    nvml = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(sampling, "_cuda_bus_ids",
                        lambda n: {"0": "00000000:3B:00.0", "1": "00000000:5E:00.0"})
    rig = Rig("cuda", 2)
    case = new_case(rig, "ddp", "resnet-tiny", 32, 8,
                    measurement=Measurement(sample_interval_ms=20))
    with sampling.case_sampler(case, rig, [1, 2]) as s:
        pass
    devices = {r["device"] for r in s.samples}
    assert devices == {"0", "1"} and s.interval_s == 0.02
    assert {r["util_gpu_pct"] for r in s.samples if r["device"] == "1"} == {91.0}


@pytest.mark.integration
def test_process_source_measures_a_real_busy_process():
    busy = subprocess.Popen([sys.executable, "-c", "print('up', flush=True)\nwhile True: pass"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert busy.stdout.readline() == "up\n"  # sample Python, not a half-started process
        with Sampler([ProcessSource({"0": busy.pid})], interval_s=0.05) as s:
            time.sleep(0.5)
    finally:
        busy.kill()
        busy.wait()
        busy.stdout.close()
    rows = s.samples
    assert len(rows) >= 3 and {r["device"] for r in rows} == {"0"}
    assert rows[0]["cpu_pct"] is None  # no interval yet
    cpu = [r["cpu_pct"] for r in rows[1:] if r["cpu_pct"] is not None]
    assert len(cpu) >= 2 and all(c >= 0 for c in cpu)  # a read too soon (the last) has none
    assert sum(cpu) > 0  # a busy loop gets some CPU however loaded the machine is
    assert all(r["rss_mib"] > 1 for r in rows)
    assert set(SAMPLE_METRICS) <= set(rows[0])


@pytest.mark.integration
def test_process_source_survives_processes_that_exit():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    rows = ProcessSource({"0": gone.pid}).read()
    assert rows == [{"device": "0", "cpu_pct": None, "rss_mib": None}]


def _powercap(tmp_path, values: dict[str, str], span: int = 1000):
    for name, value in values.items():
        d = tmp_path / name
        d.mkdir()
        (d / "energy_uj").write_text(value)
        (d / "max_energy_range_uj").write_text(str(span))
    return tmp_path


def test_rapl_sums_packages_handles_wraparound_and_ignores_subdomains(tmp_path):
    root = _powercap(tmp_path, {"intel-rapl:0": "900", "intel-rapl:1": "100",
                                "intel-rapl:0:0": "5"})
    rapl = RaplSource(root)
    assert rapl.available and rapl.read() == [{"device": "host", "energy_j": 0.0}]
    (root / "intel-rapl:0" / "energy_uj").write_text("50")  # wrapped: 900 -> 1000 -> 50
    (root / "intel-rapl:1" / "energy_uj").write_text("300")
    (root / "intel-rapl:0:0" / "energy_uj").write_text("999")
    assert rapl.read() == [{"device": "host", "energy_j": pytest.approx((150 + 200) / 1e6)}]


def test_rapl_unreadable_or_absent_gives_nothing(tmp_path):
    assert not RaplSource(tmp_path / "missing").available
    root = _powercap(tmp_path, {"intel-rapl:0": "not a number"})
    assert RaplSource(root).read() == []


def test_window_columns_hand_computed():
    def s(t, device, energy=None, cpu=None):
        return {"time_unix_s": t, "device": device, **dict.fromkeys(SAMPLE_METRICS),
                "energy_j": energy, "cpu_pct": cpu}

    samples = [
        s(9.0, "0", cpu=5.0),  # before the window: ignored
        s(10.0, "0", cpu=80.0), s(10.0, "1", cpu=50.0), s(10.0, "host", energy=100.0),
        s(11.0, "0", cpu=100.0), s(11.0, "1", cpu=60.0), s(11.0, "host", energy=130.0),
        s(12.0, "0", cpu=90.0), s(12.0, "1", cpu=70.0), s(12.0, "host", energy=160.0),
    ]
    out = window_columns(samples, [(10.0, 12.0)], images=60, idle_w={"host": 10.0})
    assert out["util_pct_mean_by_device"] == "0:90.0;1:60.0"
    assert out["util_pct_mean"] == pytest.approx(75.0)
    assert out["power_w_mean"] == pytest.approx(30.0)  # (160 - 100) J over 2 s
    assert out["energy_j_per_img"] == pytest.approx(1.0)  # 30 W * 2 s / 60 images
    assert out["energy_j_per_img_net"] == pytest.approx(20 * 2 / 60)  # (30 - 10 idle) W
    assert out["energy_source"] == "rapl-rig-packages" and out["sampler_note"] == ""
    empty = window_columns(samples, [(20.0, 21.0)], images=60)
    assert empty["energy_j_per_img"] is None and empty["util_pct_mean"] is None
    assert "under 3" in empty["sampler_note"]
    # Two launches' windows: a second one at 60 W (+120 J over 2 s) and 40%/100% busy.
    later = [s(20.0, "0", cpu=40.0), s(20.0, "1", cpu=100.0), s(20.0, "host", energy=500.0),
             s(21.0, "0", cpu=40.0), s(21.0, "1", cpu=100.0), s(21.0, "host", energy=560.0),
             s(22.0, "0", cpu=40.0), s(22.0, "1", cpu=100.0), s(22.0, "host", energy=620.0)]
    both = window_columns(samples + later, [(10.0, 12.0), (20.0, 22.0)], images=120,
                          idle_w={"host": 10.0})
    assert both["util_pct_mean_by_device"] == "0:65.0;1:80.0"  # every sample inside, pooled
    assert both["power_w_mean"] == pytest.approx((60 + 120) / 4)  # joules over 4 s of windows
    assert both["energy_j_per_img"] == pytest.approx(180 / 120)
    assert both["energy_j_per_img_net"] == pytest.approx((180 - 10 * 4) / 120)
    # The gap between the windows (another case's launch ran there) counts for nothing.
    short = window_columns(samples + later, [(10.0, 12.0), (20.0, 20.5)], images=120)
    assert short["energy_j_per_img"] is None and "0.50 s is under" in short["sampler_note"]


def test_samples_csv_has_empty_cells_for_missing_metrics(tmp_path):
    sample = {"time_unix_s": 1.5, "device": "0", **dict.fromkeys(SAMPLE_METRICS), "rss_mib": 12.0}
    with RunWriter(tmp_path) as w:
        w.write_case({"case_id": "c1", "status": "ok"}, samples=[sample])
    with (tmp_path / "samples.csv").open(newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert list(row) == SAMPLE_COLUMNS
    assert row["case_id"] == "c1" and row["rss_mib"] == "12.0" and row["power_w"] == ""


def test_bad_interval_is_refused():
    with pytest.raises(ValueError, match="positive"):
        Sampler([], interval_s=0)


@pytest.mark.gpu
def test_real_nvml_reads_the_first_gpu():
    import torch

    keys = sampling._cuda_bus_ids(1)
    with Sampler([NvmlSource(keys)], interval_s=0.05) as s:
        torch.ones(1, device="cuda").sum().item()
    assert s.samples and all(r["device"] == "0" for r in s.samples)
    assert all(r["mem_used_mib"] is not None and r["mem_used_mib"] > 0 for r in s.samples)
    assert all(r["util_gpu_pct"] is not None for r in s.samples)


@pytest.mark.timeout(180)
@pytest.mark.integration
def test_a_real_ddp_case_is_sampled_over_its_timed_window(cpu_rig, tmp_path, forks):
    from bench_lib.measure.flop_peak import AttainablePeak
    from bench_lib.measure.timing import STOP_REASONS
    from bench_lib.rows.rows import case_row

    # Enough steps for a timed window over 1 s: shorter ones get no utilisation.
    measurement = Measurement(warmup_steps=1, timed_steps=80, max_time_s=1e6,
                              case_timeout_s=150, interval_target_pct=0.0, sample_interval_ms=20)
    case = new_case(cpu_rig, "ddp", "resnet-tiny", 32, 4, measurement=measurement)
    outcome = case_launch.run_case(CaseSpec(case, cpu_rig), tmp_path,
                                   options=LaunchOptions(server=forks))
    assert outcome.status == "ok", outcome.reason
    assert {s["device"] for s in outcome.samples} == {"0", "1"}
    t0, t1 = outcome.timed_window_unix_s
    assert outcome.samples[0]["time_unix_s"] <= t0 < t1 <= outcome.samples[-1]["time_unix_s"]
    assert outcome.stop_reason in STOP_REASONS and outcome.stop_reason != "time_cap"
    if outcome.stop_reason == "step_cap":
        assert len(outcome.step_times_s) == 80
    row = case_row(case, cpu_rig, outcome, AttainablePeak({"fp32": {"0": 1.0, "1": 1.0}}))
    util = row["util_pct_mean_by_device"]
    assert t1 - t0 >= 1.0 and util.startswith("0:") and ";1:" in util, row["sampler_note"]
    # 0-100 of the one core each worker holds (a little over 100 is gloo's own threads).
    assert all(0 <= float(v.split(":")[1]) <= 150 for v in util.split(";"))
    assert row["mem_imbalance_ratio"] >= 1.0
    assert row["mfu_pct"] == pytest.approx(100 * row["achieved_tflop_s"] / 2.0)
