"""Utilisation that says what it counts (#28 item 8): GPM SM activity where the GPU has it,
NVML's kernel-active time labelled as such otherwise, and every case's figure checked
against the busy share its own compute gives, flagged over 20 points apart."""

from __future__ import annotations

import types

import pytest

from bench_lib.analysis import utilisation
from bench_lib.launch.protocol import CaseOutcome
from bench_lib.results.schema import SAMPLE_METRIC_NAMES
from bench_lib.rig import Rig
from bench_lib.rows.sampler_columns import util_check_columns, window_columns
from bench_lib.sweep.cases import new_case


def _sample(t: float, device: str, **metrics: float | None) -> dict:
    return {"time_unix_s": t, "device": device, **dict.fromkeys(SAMPLE_METRIC_NAMES),
            **metrics}


def _gpus(kernel: dict[str, float], gpm: dict[str, float | None],
          times: tuple[float, ...] = (10.0, 10.5, 11.0, 11.5, 12.0)) -> list[dict]:
    """GPU samples at ``times``: each device's kernel-active and GPM SM activity."""
    return [_sample(t, d, util_gpu_pct=kernel[d], sm_util_pct=gpm.get(d))
            for t in times for d in kernel]


def test_gpm_sm_activity_is_preferred_over_kernel_active_time_and_named():
    # NCCL's kernels spin while waiting: kernel-active reads 98-99%, the SMs are 55-61% busy.
    samples = _gpus({"0": 98.0, "1": 99.0}, {"0": 55.0, "1": 61.0})
    cols = window_columns(samples, [(10.0, 12.0)], images=64)
    assert cols["util_pct_mean_by_device"] == "0:55.0;1:61.0"
    assert cols["util_pct_mean"] == pytest.approx(58.0)
    assert cols["util_source"] == "gpm-sm-activity"


def test_a_gpu_without_gpm_reads_kernel_active_time_labelled_so():
    cols = window_columns(_gpus({"0": 98.0, "1": 96.0}, {}), [(10.0, 12.0)], images=64)
    assert cols["util_pct_mean"] == pytest.approx(97.0)
    assert cols["util_source"] == "nvml-kernel-active"


def test_a_gpu_whose_gpm_is_thin_in_a_window_falls_back_for_the_whole_case():
    # GPU 0's GPM gave two samples in the second launch's window: it is not averaged with
    # kernel-active time there; its figure is kernel-active throughout. GPU 1 keeps GPM.
    first = _gpus({"0": 90.0, "1": 90.0}, {"0": 50.0, "1": 40.0})
    second = _gpus({"0": 80.0, "1": 80.0}, {"1": 60.0}, times=(20.0, 20.5, 21.0, 21.5, 22.0))
    second += [_sample(t, "0", sm_util_pct=70.0) for t in (20.2, 21.2)]
    cols = window_columns(first + second, [(10.0, 12.0), (20.0, 22.0)], images=64)
    assert cols["util_pct_mean_by_device"] == "0:85.0;1:50.0"
    assert cols["util_source"] == "0:nvml-kernel-active;1:gpm-sm-activity"


def test_cpu_workers_read_their_cpu_time():
    samples = [_sample(t, d, cpu_pct=c) for t in (10.0, 11.0, 12.0)
               for d, c in (("0", 90.0), ("1", 70.0))]
    cols = window_columns(samples, [(10.0, 12.0)], images=64)
    assert cols["util_pct_mean"] == pytest.approx(80.0) and cols["util_source"] == "cpu-time"
    thin = window_columns(samples, [(10.0, 10.5)], images=64)
    assert thin["util_source"] == "" and thin["util_pct_mean"] is None


def test_disagreement_is_flagged_over_twenty_points_either_way_with_what_the_counter_counts():
    assert utilisation.disagreement(80.0, 60.0, "nvml-kernel-active") == ""  # 20: within
    over = utilisation.disagreement(98.0, 60.0, "nvml-kernel-active")
    assert over.startswith("utilisation 98% is 38 points above the 60% of the step")
    assert "NCCL's waiting for a peer too" in over
    under = utilisation.disagreement(35.0, 60.0, "gpm-sm-activity")
    assert "25 points below" in under and "too small to fill the GPU" in under
    idle = utilisation.disagreement(30.0, 60.0, "nvml-kernel-active")
    assert "waited between kernels" in idle and "NCCL" not in idle
    mixed = utilisation.disagreement(99.0, 50.0, "0:gpm-sm-activity;1:nvml-kernel-active")
    assert "SMs a waiting NCCL kernel holds" in mixed and "NCCL's waiting for a peer" in mixed
    waited = utilisation.disagreement(40.0, 100.0, "cpu-time")
    assert "waited for a core (the contention column)" in waited


def _row(util: float, source: str, median: float = 1.0) -> dict:
    return {"util_pct_mean": util, "util_source": source, "step_time_s_median": median}


def test_ddp_waiting_in_nccl_reads_busy_and_is_flagged_against_its_compute_steps():
    rig = Rig("cuda", 2)
    ddp = new_case(rig, "ddp", "resnet50", 128, 32)
    ok = CaseOutcome("ok", compute_step_s=0.6)  # compute-only steps: 60% of the 1-s step
    kernel = util_check_columns(ddp, rig, ok, _row(98.0, "nvml-kernel-active"))
    assert kernel["util_timeline_pct"] == pytest.approx(60.0)
    assert "38 points above" in kernel["util_check"]
    gpm = util_check_columns(ddp, rig, ok, _row(55.0, "gpm-sm-activity"))
    assert gpm == {"util_timeline_pct": pytest.approx(60.0), "util_check": ""}
    # Compute steps slower than the median step count as the whole step, not over 100%.
    slow = util_check_columns(ddp, rig, CaseOutcome("ok", compute_step_s=1.3),
                              _row(97.0, "nvml-kernel-active"))
    assert slow == {"util_timeline_pct": 100.0, "util_check": ""}


def _timeline(busy: dict[str, float]) -> tuple[dict, ...]:
    """One pass per device from t=0, ``busy`` seconds long, in one process (rank 0)."""
    return tuple({"rank": 0, "device": d, "stage": i, "microbatch": 0, "phase": "fwd",
                  "start_s": 0.0, "end_s": b} for i, (d, b) in enumerate(busy.items()))


def test_pipelines_are_checked_against_their_traced_passes_per_device():
    rig = Rig("cuda", 2)
    # mp on two GPUs, one process: each GPU's passes in the 0.5-s traced step, 0.25 s and
    # 0.5 s: busy 75% of the step on average (the traced step is the median's length).
    mp = new_case(rig, "mp", "resnet50", 128, 32, partition="balanced")
    traced = CaseOutcome("ok", timeline=_timeline({"cuda:0": 0.25, "cuda:1": 0.5}),
                         traced_step_s=0.5)
    cols = util_check_columns(mp, rig, traced, _row(90.0, "nvml-kernel-active", 0.5))
    assert cols["util_timeline_pct"] == pytest.approx(75.0) and cols["util_check"] == ""
    # The optimizer's share of each device (half the model each) counts as compute too.
    with_opt = util_check_columns(mp, rig, traced, _row(99.0, "nvml-kernel-active", 0.5),
                                  optimizer_s=0.1)
    assert with_opt["util_timeline_pct"] == pytest.approx(100 * (0.375 + 0.05) / 0.5)
    idle = util_check_columns(mp, rig, traced, _row(40.0, "nvml-kernel-active", 0.5))
    assert "35 points below" in idle["util_check"]


def test_cases_with_no_compute_measure_of_their_own_are_not_checked(cpu_rig):
    rig = Rig("cuda", 2)
    single = new_case(rig, "single", "resnet50", 128, 32)
    kernel = _row(97.0, "nvml-kernel-active")
    assert util_check_columns(single, rig, CaseOutcome("ok"), kernel) == {}
    ddp = new_case(rig, "ddp", "resnet50", 128, 32)
    no_util = {"util_pct_mean": None, "step_time_s_median": 1.0}
    assert util_check_columns(ddp, rig, CaseOutcome("ok", compute_step_s=0.6), no_util) == {}
    # One cpu worker drives both device slots: its CPU time is the process's, not a slot's.
    mp = new_case(cpu_rig, "mp", "resnet50", 64, 16, partition="balanced")
    traced = CaseOutcome("ok", timeline=_timeline({"cpu:0": 0.25, "cpu:1": 0.25}),
                         traced_step_s=0.5)
    assert util_check_columns(mp, cpu_rig, traced, _row(100.0, "cpu-time", 0.5)) == {}
    # A cpu rig's ddp: its workers' CPU time against its compute-only steps.
    cpu_ddp = new_case(cpu_rig, "ddp", "resnet50", 64, 16)
    cols = util_check_columns(cpu_ddp, cpu_rig, CaseOutcome("ok", compute_step_s=0.2),
                              _row(95.0, "cpu-time", 0.29))
    assert cols["util_timeline_pct"] == pytest.approx(100 * 0.2 / 0.29)
    assert "reductions and copies" in cols["util_check"]


def test_the_report_names_the_counter_and_lists_the_cases_that_disagree(tmp_path):
    import matplotlib.pyplot as plt
    import pandas as pd

    from bench_lib.report import device_figures
    from bench_lib.report.html import _utilisation_check
    from tests.test_report import load, synthetic_run

    runs = load(synthetic_run(tmp_path))
    # Section 5's figure draws GPM SM activity where the samples have it, and says so.
    gpu = runs.samples.assign(sm_util_pct=60.0, util_gpu_pct=99.0, cpu_pct=None)
    fig = device_figures.fig_samples(runs.swept, gpu)
    assert fig.axes[0].get_ylabel() == "GPM SM activity (%)"
    plt.close(fig)
    fig = device_figures.fig_samples(runs.swept, gpu.assign(sm_util_pct=None))
    assert fig.axes[0].get_ylabel() == "kernel-active, NVML (%)"
    plt.close(fig)
    cases = pd.DataFrame([
        {"case_id": "ddp_a", "util_pct_mean": 98.0, "util_source": "nvml-kernel-active",
         "util_timeline_pct": 60.0,
         "util_check": utilisation.disagreement(98.0, 60.0, "nvml-kernel-active")},
        {"case_id": "1f1b_b", "util_pct_mean": 70.0, "util_source": "nvml-kernel-active",
         "util_timeline_pct": 65.0, "util_check": ""},
        {"case_id": "single_c", "util_pct_mean": 99.0, "util_source": "nvml-kernel-active",
         "util_timeline_pct": None, "util_check": None}])
    said = _utilisation_check(cases)
    assert "Utilisation of 2 cases checked" in said and "1 disagrees by over 20" in said
    assert "ddp_a" in said and "1f1b_b" not in said and "nvml-kernel-active" in said
    assert _utilisation_check(cases.iloc[2:]) == ""  # nothing checked: nothing said


def test_a_mig_instance_is_read_as_its_own_share_of_the_card(monkeypatch):
    """Under MIG NVML's utilisation, power and energy are the card's, every instance's work:
    the instance's utilisation is its own GPM SM activity, and the rest is said, not read."""
    from bench_lib.launch import sampling
    from bench_lib.measure.nvml_source import NvmlSource
    from bench_lib.measure.sampler import Sampler
    from tests.test_gpu_env import topo_nvml
    from tests.test_monitor import MIB, fake_nvml

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-cccc-3333")
    assert sampling._cuda_bus_ids(1, topo_nvml()) == {"0": "MIG-cccc-3333"}

    nvml = fake_nvml()
    card_reads: list[str] = []
    mig_samples: list[tuple[object, int]] = []
    nvml.nvmlDeviceGetHandleByUUID = lambda uuid: ("mig", uuid)
    nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle = lambda mig: 0  # card 0
    nvml.nvmlDeviceGetGpuInstanceId = lambda mig: 3

    def card_only(name, fn):
        def read(h, *args):
            card_reads.append(name)
            return fn(h, *args)
        return read

    for name in ("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetPowerUsage",
                 "nvmlDeviceGetTotalEnergyConsumption", "nvmlGpmSampleGet"):
        setattr(nvml, name, card_only(name, getattr(nvml, name)))
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        used=(512 if isinstance(h, tuple) else 60_000) * MIB)  # the instance's, the card's

    def mig_sample_get(h, gi, sample):
        mig_samples.append((h, gi))
        return sample

    nvml.nvmlGpmMigSampleGet = mig_sample_get
    source = NvmlSource({"0": "MIG-cccc-3333"}, nvml=nvml)
    (row,) = source.read()
    assert card_reads == []  # nothing of the card's work read as the instance's
    assert mig_samples == [(0, 3), (0, 3)]  # on opening and at this read: its own GPM
    assert row["util_gpu_pct"] is None and row["power_w"] is None and row["energy_j"] is None
    assert row["mem_used_mib"] == 512.0 and row["sm_util_pct"] == 71.0
    assert row["sm_clock_mhz"] == 1980  # the card's clocks are the instance's too
    with Sampler([source], interval_s=0.05) as s:
        pass
    assert "device 0 is a MIG instance" in s.note and "not read" in s.note
    samples = [{**r, "time_unix_s": 10.0 + i / 2} for i, r in enumerate(s.samples * 5)]
    cols = window_columns(samples, [(10.0, 12.0)], images=64)
    assert cols["util_source"] == "gpm-sm-activity" and cols["util_pct_mean"] == 71.0
    assert cols["energy_j_per_img"] is None and "no readable energy counter" in cols["sampler_note"]
    # A whole GPU beside it keeps every counter.
    whole = NvmlSource({"0": 1}, nvml=nvml)
    (row,) = whole.read()
    assert row["util_gpu_pct"] == 91.0 and row["energy_j"] is not None and whole.note == ""
