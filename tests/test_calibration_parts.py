"""Where a calibration's time goes, and how many passes it takes (#39, item 2): the pass
rules (``prediction.calibration_timing``: fixed counts on a cpu rig, a settling rule on a cuda
rig), the worker's stamps (``prediction.calibration_worker``), their parts and line
(``prediction.calibration``), and calibration.json with and without them."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from bench_lib.prediction import calibration_timing
from bench_lib.prediction import calibration_worker as worker
from bench_lib.prediction.calibration import (
    CalibrationKey,
    CalibrationSpec,
    calibration_from_ranks,
    describe_calibration,
    parts_of,
    summary_parts,
)
from bench_lib.prediction.calibration_data import BatchCosts, Calibration, Sizes
from bench_lib.prediction.calibration_file import read_calibrations, write_calibrations
from bench_lib.rig import Rig
from bench_lib.topology import available_cores

EVIDENCE = Path(__file__).parent / "data" / "h100-2026-11-26" / "resnet50-224-single-accum"
KEY = CalibrationKey("resnet-tiny", 32, "fp32", "ce")


class FakeClock:
    """``time.perf_counter`` for a fake step: each call of ``step`` moves it on by the next
    of ``durations`` (then by the last one, forever)."""

    def __init__(self, durations: list[float]) -> None:
        self.now = 0.0
        self.durations = durations
        self.calls = 0

    def __call__(self) -> float:
        return self.now

    def step(self) -> None:
        i = min(self.calls, len(self.durations) - 1)
        self.now += self.durations[i]
        self.calls += 1


def steady(first_s: float, step_s: float, n: int = 200) -> list[float]:
    """A first step of ``first_s`` (cuDNN autotuning), then steps of ``step_s`` with a
    0.3% wobble (a GPU's steady steps)."""
    return [first_s] + [step_s * (1 + 0.003 * ((i % 3) - 1)) for i in range(n)]


@pytest.fixture
def clock(monkeypatch):
    def make(durations: list[float]) -> FakeClock:
        fake = FakeClock(durations)
        monkeypatch.setattr(time, "perf_counter", fake)
        return fake

    return make


@pytest.mark.parametrize(("step_s", "repeats"), [(0.068, 5), (0.020, 8)])
def test_the_cuda_rule_counts_the_autotuning_step_as_warm_up_and_stops_on_its_budget(
        clock, step_s, repeats):
    """ResNet50 224 px on an H100: batch 120 (0.068 s) stops when its 0.3 s are spent,
    batch 20 (0.020 s) as soon as its median's interval is first judged (8 passes); the
    3 s first step is warm-up, never in the median."""
    fake = clock(steady(3.0, step_s))
    found = calibration_timing.step_passes(fake.step, [torch.device("cpu")],
                                           calibration_timing.pass_rule("cuda"))
    assert found.warmup >= 2 and found.warmup_s >= 3.0
    assert found.median_s == pytest.approx(step_s, rel=0.005)
    assert found.repeats == repeats
    assert found.timed_s <= calibration_timing.CUDA_RULE.max_time_s + step_s
    assert fake.calls == found.warmup + found.repeats


def test_the_cuda_rule_warms_up_until_the_steps_stop_falling(clock):
    """Steps still getting faster after the autotuning one are warm-up too (``WarmupRule``)."""
    fake = clock([3.0, 0.2, 0.12, 0.08, *steady(0.068, 0.068)])
    found = calibration_timing.step_passes(fake.step, [torch.device("cpu")],
                                           calibration_timing.pass_rule("cuda"))
    assert found.warmup >= 5  # 3.0, 0.2, 0.12, 0.08 and the first steady one that shows it
    assert found.median_s == pytest.approx(0.068, rel=0.005)


def test_the_cuda_rule_times_at_least_three_slow_steps(clock):
    fake = clock(steady(4.0, 0.5))
    found = calibration_timing.step_passes(fake.step, [torch.device("cpu")],
                                           calibration_timing.pass_rule("cuda"))
    assert found.repeats == 3 and found.median_s == pytest.approx(0.5, rel=0.005)


def test_the_cpu_rule_is_two_untimed_and_three_timed_passes(clock):
    fake = clock([1.0, 0.5, 0.30, 0.33, 0.29, 9.0])
    found = calibration_timing.step_passes(fake.step, [torch.device("cpu")],
                                           calibration_timing.pass_rule("cpu"))
    assert (found.warmup, found.repeats) == (2, 3)
    assert (calibration_timing.WARMUP, calibration_timing.REPEATS) == (2, 3)
    assert found.median_s == pytest.approx(0.30)
    assert found.warmup_s == pytest.approx(1.5) and found.timed_s == pytest.approx(0.92)
    assert fake.calls == 5


def test_parts_add_up_to_the_wall_time_and_make_the_line():
    rank0 = {"main_s": 10.0, "stamps": [
        ["cuda_context_s", 10.5], ["model_build_s", 11.0], ["alone_20_warmup_s", 14.0],
        ["alone_20_timed_s", 14.2], ["optimizer_passes_s", 14.21], ["finish_s", 14.3]]}
    parts = parts_of(rank0, 9.8, 14.6)
    assert list(parts) == ["process_start_s", "cuda_context_s", "model_build_s",
                           "alone_20_warmup_s", "alone_20_timed_s", "optimizer_passes_s",
                           "finish_s", "teardown_s"]
    assert parts["process_start_s"] == pytest.approx(0.2)
    assert parts["alone_20_warmup_s"] == pytest.approx(3.0)
    assert parts["teardown_s"] == pytest.approx(0.3)
    assert sum(parts.values()) == pytest.approx(4.8)
    assert summary_parts(parts) == pytest.approx(
        {"start": 0.2, "CUDA": 0.5, "model": 0.5, "warm-up": 3.0, "timed": 0.21, "end": 0.39})
    cal = Calibration(0.01, {20: BatchCosts(0.02)}, wall_s=4.8, parts_s=parts)
    assert describe_calibration(KEY, cal).startswith(
        "calibrated resnet-tiny 32 px fp32 in 4.8 s (start 0.2, CUDA 0.5, model 0.5, "
        "warm-up 3.0, timed 0.2, end 0.4): alone at 20;")
    # A rank file from before the stamps gives no parts, and the line none.
    assert parts_of({"optimizer_s": 0.01, "alone": {}}, 9.8, 14.6) == {}
    assert describe_calibration(KEY, Calibration(0.01, {20: BatchCosts(0.02)}, wall_s=4.8)
                                ).startswith("calibrated resnet-tiny 32 px fp32 in 4.8 s: alone")


def test_calibration_json_round_trips_its_parts_and_reads_files_without_them(tmp_path):
    ranks = [{"optimizer_s": 0.01, "alone": {"16": BatchCosts(0.2).as_dict()}, "together": {},
              "copies": {}, "steps": {"alone_16": [3, 5]}}]
    cal = calibration_from_ranks(ranks, 2.5)
    assert cal.steps == {"alone_16": (3, 5)}
    parts = {"process_start_s": 0.1, "model_build_s": 0.4, "alone_16_warmup_s": 1.5,
             "alone_16_timed_s": 0.3, "teardown_s": 0.2}
    cal = Calibration(cal.optimizer_s, cal.alone, cal.together, cal.devices, cal.wall_s,
                      cal.copies, parts, cal.steps)
    write_calibrations(tmp_path / "calibration.json", {KEY: cal}, "hw")
    back = read_calibrations(tmp_path / "calibration.json")[KEY]
    assert back == cal and list(back.parts_s) == list(parts)  # the order they ran in
    # The H100 evidence's file has no parts: read as before, with none.
    old = read_calibrations(EVIDENCE / "calibration.json")
    assert len(old) == 2
    for found in old.values():
        assert isinstance(found, Calibration)
        assert found.parts_s == {} and found.steps == {}
        assert set(found.alone) == {20, 120} and found.wall_s > 20
    fp32 = next(c for k, c in old.items() if k.precision == "fp32")
    assert isinstance(fp32, Calibration)
    assert fp32.alone[120].step_s == pytest.approx(0.0675, abs=1e-4)


def one_device_spec(tmp_path: Path, kind: str = "cpu") -> CalibrationSpec:
    rig = Rig("cpu", 1, 1, tuple(available_cores()[:1])) if kind == "cpu" else Rig("cuda", 1)
    spec = CalibrationSpec(KEY, rig, 1, Sizes(frozenset({2, 4}), frozenset({2}),
                                              frozenset({2}), frozenset({4096})))
    spec.write(tmp_path / "spec.json")
    return spec


def test_a_cpu_rank_stamps_every_part_in_order(tmp_path, monkeypatch, restore_math_flags):
    # Not this test's process to the rig's cores; one thread, as a worker has.
    monkeypatch.setattr(worker, "pin_worker", lambda rig, rank: torch.set_num_threads(1))
    spec = one_device_spec(tmp_path)
    started = time.monotonic()
    assert worker.main([str(tmp_path / "spec.json"), "0"]) == 0
    ended = time.monotonic()
    found = json.loads((tmp_path / "calibration0.json").read_text())
    names = [name for name, _ in found["stamps"]]
    assert names == ["model_build_s", "alone_2_warmup_s", "alone_2_timed_s",
                     "alone_4_warmup_s", "alone_4_timed_s", "optimizer_passes_s",
                     "together_2_warmup_s", "together_2_timed_s", "blocks_2_s", "copies_s",
                     "finish_s"]  # no CUDA context, no process group: one cpu device
    ends = [t for _, t in found["stamps"]]
    assert started <= found["main_s"] <= ends[0] and ends == sorted(ends) and ends[-1] <= ended
    # The fixed counts the prediction's figures were measured with, no more.
    assert found["steps"] == {"alone_2": [2, 3], "alone_4": [2, 3], "together_2": [2, 3]}
    parts = parts_of(found, started, ended)
    assert sum(parts.values()) == pytest.approx(ended - started, abs=1e-3)
    assert all(s >= 0 for s in parts.values())
    assert set(found["alone"]) == {"2", "4"} and found["optimizer_s"] > 0
    assert spec.sizes.copies == {4096} and set(found["copies"]) == {"4096"}


def test_a_cuda_rank_creates_its_context_first_and_settles_its_passes(
        tmp_path, monkeypatch, restore_math_flags):
    """The cuda path on a CPU: the rig's devices faked onto the CPU, its CUDA context's
    creation recorded; each size then warms up and stops by the settling rule."""
    created = []
    torch.set_num_threads(1)  # as a worker has (the fixture puts it back)
    monkeypatch.setattr(Rig, "device", lambda self, index: torch.device("cpu"))
    monkeypatch.setattr(worker, "init_cuda", created.append)
    monkeypatch.setattr(calibration_timing, "CUDA_RULE", calibration_timing.PassRule(
        warmup=1, repeats=50, settle=True, max_time_s=0.05))  # a CPU's slow steps
    spec = one_device_spec(tmp_path, "cuda")
    stamps: worker.Stamps = []
    found = worker.run_rank(spec, 0, tmp_path, stamps)
    assert created == [[torch.device("cpu")]]
    assert stamps[0][0] == "cuda_context_s" and stamps[1][0] == "model_build_s"
    steps = found["steps"]
    assert isinstance(steps, dict) and set(steps) == {"alone_2", "alone_4", "together_2"}
    for warm, timed in steps.values():
        assert warm >= 2 and 3 <= timed <= 50  # warm-up until steady; at least 3 timed


@pytest.mark.integration
def test_a_real_launch_records_parts_that_add_up_to_its_wall_time(tmp_path, forks):
    """One calibration launch of a one-worker cpu rig, forked by the fork server: the
    runner's and the rank's monotonic stamps subtract (one clock for the host)."""
    from bench_lib.prediction.calibration import calibrate

    rig = Rig("cpu", 1, 1, tuple(available_cores()[:1]))
    cal = calibrate(KEY, Sizes(frozenset({4})), rig, tmp_path, server=forks)
    assert isinstance(cal, Calibration), cal
    assert list(cal.parts_s)[:2] == ["process_start_s", "model_build_s"]
    assert list(cal.parts_s)[-2:] == ["finish_s", "teardown_s"]
    assert sum(cal.parts_s.values()) == pytest.approx(cal.wall_s, abs=2e-3)
    assert all(s >= 0 for s in cal.parts_s.values())
    assert cal.steps == {"alone_4": (2, 3)}
    assert f"in {cal.wall_s:.1f} s (start " in describe_calibration(KEY, cal)
