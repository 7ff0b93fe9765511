"""The run estimate (#39 item 3): its parts sum, a case that won't run costs nothing, the
per-run terms only where they apply, default-cuda within 45 minutes on 2 GPUs with every
seed question, the dry run's lines, the progress bar's first ETA."""

from __future__ import annotations

import dataclasses
import io

import pytest

from bench_lib import commands
from bench_lib.launch.protocol import CaseOutcome
from bench_lib.measure.timing import COMPUTE_ONLY_STEPS
from bench_lib.prediction import duration
from bench_lib.prediction.duration import (
    Estimate,
    case_estimate,
    run_estimate,
    steady_warmup_steps,
    step_seconds,
)
from bench_lib.prediction.fixed_costs import CPU, CUDA
from bench_lib.rig import Rig
from bench_lib.run.progress import Progress
from bench_lib.sweep import splits
from bench_lib.sweep.cases import new_case
from bench_lib.sweep.expansion import expand
from bench_lib.sweep.profile import PROFILE_DIR, Measurement, load_profile

CPU_RIG = Rig("cpu", 2, 1, (0, 1))
TWO_GPUS = Rig("cuda", 2)
M = Measurement(launches=3, warmup_steps=1, timed_steps=8, max_time_s=6.0, min_time_s=0.0,
                case_timeout_s=1000.0)


def test_a_case_is_its_launches_start_up_warm_up_and_timed_steps():
    single = new_case(CPU_RIG, "single", "resnet50", 64, 16, measurement=M)
    step = step_seconds(single, CPU_RIG)
    timed = min(8 * step, max(6.0, 3 * step))
    # Warm-up: 3 steps in the first launch, 1 in each later one; every launch's first slow.
    assert steady_warmup_steps(1, 3) == 2
    est = case_estimate(single, CPU_RIG)
    assert est.startup_s == pytest.approx(3 * CPU.launch_s)
    assert est.warmup_s == pytest.approx(3 * CPU.first_step_s + 2 * step)
    assert est.timed_s == pytest.approx(3 * timed)
    assert duration.case_seconds(single, CPU_RIG) == pytest.approx(est.total_s)
    # Every launch of ddp adds its compute-only steps (3 launches x COMPUTE_ONLY_STEPS); a
    # pipeline's first launch its traced step.
    ddp = new_case(CPU_RIG, "ddp", "resnet50", 64, 16, measurement=M)
    assert case_estimate(ddp, CPU_RIG).startup_s == pytest.approx(
        3 * CPU.launch_s + 3 * COMPUTE_ONLY_STEPS * step_seconds(ddp, CPU_RIG))
    one = dataclasses.replace(ddp, measurement=dataclasses.replace(M, launches=1))
    assert case_estimate(one, CPU_RIG).startup_s == pytest.approx(
        CPU.launch_s + COMPUTE_ONLY_STEPS * step_seconds(ddp, CPU_RIG))


def test_a_cuda_launch_pays_nccl_only_on_nccl_and_autotuning_only_with_convolutions():
    ddp = new_case(TWO_GPUS, "ddp", "resnet50", 224, 120, measurement=M)
    slots = Rig("cuda", 2, gpu_slots=2)
    gloo = new_case(slots, "ddp", "resnet50", 224, 120, measurement=M)
    assert case_estimate(ddp, TWO_GPUS).startup_s - case_estimate(gloo, slots).startup_s \
        == pytest.approx(3 * CUDA.process_group_s)
    one = Rig("cuda", 1)
    conv = case_estimate(new_case(one, "single", "resnet50", 224, 120, measurement=M), one)
    toy = case_estimate(new_case(one, "single", "toy", 224, 120, measurement=M), one)
    assert conv.warmup_s - toy.warmup_s > 3 * CUDA.first_step_s * 0.99


def test_a_case_that_will_not_run_costs_nothing():
    cases = expand(load_profile(PROFILE_DIR / "smoke.toml"), CPU_RIG)
    unrun = [c for c in cases if c.status is not None]
    assert unrun  # dp needs CUDA
    for case in unrun:
        assert case_estimate(case, CPU_RIG) == Estimate()
    ran = run_estimate(cases, CPU_RIG, rig_figures=False)
    assert ran.launches == run_estimate([c for c in cases if c.status is None], CPU_RIG,
                                        rig_figures=False).launches
    assert ran.launch_count == sum(c.measurement.launches for c in cases if c.status is None)


def test_a_candidate_costs_its_share_of_being_measured(monkeypatch):
    case = new_case(CPU_RIG, "pipeline", "resnet50", 64, 16, split_size=4, measurement=M)
    whole = case_estimate(case, CPU_RIG)
    monkeypatch.setattr(splits, "measured_share", lambda c: 0.25)
    assert case_estimate(case, CPU_RIG).total_s == pytest.approx(whole.total_s / 4)
    assert run_estimate([case], CPU_RIG).launch_count == pytest.approx(0.75)


def test_the_run_is_its_parts_and_each_per_run_term_only_where_it_applies():
    single = new_case(TWO_GPUS, "single", "resnet50", 224, 120, measurement=M)
    ddp = new_case(TWO_GPUS, "ddp", "resnet50", 224, 120, measurement=M)
    bare = run_estimate([single], TWO_GPUS, rig_figures=False, predict_time=False)
    assert (bare.rig_figures_s, bare.collectives_s, bare.calibration_s) == (0.0, 0.0, 0.0)
    assert bare.setup_s == CUDA.run_s  # pre-flight and the run's own, always
    assert bare.total_s == pytest.approx(CUDA.run_s + case_estimate(single, TWO_GPUS).total_s)
    full = run_estimate([single, ddp], TWO_GPUS, rig_figures=True, predict_time=True)
    assert full.rig_figures_s == CUDA.rig_figures_s
    assert full.collectives_s == CUDA.collectives_s  # ddp over 2 GPUs is priced with them
    # One workload: single's 120 alone, ddp's share 60 together and alone (the predicted
    # parts price the smaller batch with it).
    assert (full.workloads, full.sizes) == (1, 3)
    assert full.calibration_s == pytest.approx(3 * CUDA.calibration_size_s)
    assert full.total_s == pytest.approx(full.per_run_s + full.calibration_s
                                         + full.launches.total_s)
    assert full.duty_cycle == pytest.approx(full.launches.timed_s / full.total_s)
    # One GPU has no collectives to measure, whatever the cases.
    one = Rig("cuda", 1)
    assert run_estimate([dataclasses.replace(ddp, world_size=1)], one).collectives_s == 0.0


def default_cuda_on_two_gpus():
    profile = load_profile(PROFILE_DIR / "default-cuda.toml")
    cases = expand(profile, TWO_GPUS)
    return profile, cases, run_estimate(cases, TWO_GPUS, profile.rig_figures,
                                        profile.predict_time)


def test_default_cuda_fits_45_minutes_on_two_gpus():
    _, _, est = default_cuda_on_two_gpus()
    assert est.total_s <= 45 * 60, est.parts_line()


def test_default_cuda_still_answers_every_seed_question_on_two_gpus():
    profile, cases, _ = default_cuda_on_two_gpus()
    run = [c for c in cases if c.status is None]
    strategies = {c.strategy for c in run}
    assert {"single", "dp", "ddp", "fsdp", "mp", "pipeline", "gpipe", "1f1b",
            "interleaved-1f1b"} <= strategies
    assert all(c.measurement.launches >= 3 for c in run)
    assert len({c.image_size for c in run}) >= 2  # pipelining over image sizes
    for name in ("pipeline", "gpipe", "1f1b", "interleaved-1f1b"):
        for image in {c.image_size for c in run}:
            splits = {c.split_size for c in run if c.strategy == name and c.image_size == image}
            assert len(splits) >= 3, (name, image, splits)  # over split sizes
    assert any(c.strategy == "pipeline" and c.partition == "tutorial" for c in run)
    assert profile.batch_curve  # what a device loses with fewer images at once


def test_the_dry_run_prints_the_estimate_and_its_parts(tmp_path, capsys):
    code = commands.main(["run", "--dry-run", "--rig", "cuda", "--devices", "2", "--profile",
                          "default", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    at = next(i for i, line in enumerate(out) if "estimated duration" in line)
    total, parts = out[at:at + 2]
    assert out[-1].startswith("peak MiB per device")
    _, _, est = default_cuda_on_two_gpus()
    assert f"estimated duration ~{duration.format_duration(est.total_s)}" in total
    assert parts == est.parts_line()
    assert parts.startswith(f"estimated duty cycle {est.duty_cycle:.0%}: per run ")
    for word in ("set-up", "rig figures", "collectives", "calibration", "launches",
                 "start-up", "warm-up", "timed"):
        assert word in parts


class FakeCase:
    strategy = "single"

    def describe(self) -> str:
        return "single x"


def test_the_first_eta_counts_the_calibrations_still_to_come(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("bench_lib.run.progress.time.monotonic", lambda: now[0])
    progress = Progress([30.0, 60.0], stream=io.StringIO(), launches=[3, 3],
                        calibration_s=20.0, calibrations=2)
    assert progress.eta_s() == pytest.approx(110.0)  # before anything: the estimate
    now[0] = 120.0  # the first calibration took twice its 10 s
    progress.calibrated()
    assert progress.eta_s() == pytest.approx((90.0 + 10.0) * 2.0)
    now[0] = 140.0  # then a launch estimated at 10 s took 20 s: the pace stays 2
    progress.launch_done(0, FakeCase(), 0, CaseOutcome("ok", step_times_s=[0.1]))
    assert progress.eta_s() == pytest.approx((80.0 + 10.0) * 2.0)
    progress.calibrated()
    progress.calibrated()  # one too many: nothing left to count
    assert progress.calibration_left_s == 0.0
