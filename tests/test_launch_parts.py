"""Where a launch's time goes (launch/launch_parts.py, the worker's stamps, duty.json's parts).

The parts' arithmetic on hand-made stamps, a real cpu launch whose parts add up to its
fixed cost, the cuda path's stamps with torch.cuda faked, and duty.json's parts: written,
read back, added over sittings, read from the H100 evidence's older files, and printed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench_lib.launch import worker
from bench_lib.launch.launch_parts import (
    DONE,
    LAUNCH_PARTS,
    MAIN,
    SPANS,
    span,
    with_unaccounted,
    worker_parts,
)
from bench_lib.launch.protocol import CaseSpec, RankResult
from bench_lib.launch.ranks import combine
from bench_lib.rig import Rig
from bench_lib.run.case_launch import LaunchOptions, run_case
from bench_lib.run.duty import DUTY_FILE, DutyCycle, DutyMeter, write_duty
from bench_lib.sweep.cases import new_case
from bench_lib.sweep.profile import Measurement

EVIDENCE = Path(__file__).parent / "data" / "h100-2026-11-26"
MEASUREMENT = Measurement(warmup_steps=2, timed_steps=3, max_time_s=30, case_timeout_s=120)


def rank_stamps(main: float, group: tuple[float, float], build: tuple[float, float],
                diagnostics: float, done: float) -> dict[str, float]:
    return {MAIN: main, "process_group_start": group[0], "process_group_end": group[1],
            "model_build_start": build[0], "model_build_end": build[1],
            "diagnostics_start": diagnostics, DONE: done}


# ---- the arithmetic ------------------------------------------------------------------------

def test_parts_on_one_clock_run_between_the_last_ranks_stamps():
    # Rank 1 starts 0.3 s late; rank 0 waits for it in init_process_group (0.5 s span), but
    # the group itself takes 0.25 s once both are there: the wait is rank 1's process start.
    r0 = rank_stamps(1.0, (1.1, 1.6), (1.7, 2.2), 3.0, 3.5)
    r1 = rank_stamps(1.3, (1.35, 1.6), (1.7, 2.4), 3.0, 3.4)
    parts = worker_parts([r0, r1], requested_s=0.9, reaped_s=3.8)
    assert parts == pytest.approx({"process_start_s": 0.4, "process_group_s": 0.25,
                                   "model_build_s": 0.7, "diagnostics_s": 0.5,
                                   "teardown_s": 0.3})
    # No CUDA stamps on a cpu rig: no part, not a zero.
    assert "cuda_context_s" not in parts


def test_without_the_runners_clock_each_part_is_the_slowest_ranks_span():
    """torchrun: the runner never saw the ranks requested, and across nodes the ranks'
    clocks differ; process start and teardown are absent."""
    r0 = rank_stamps(1.0, (1.1, 1.6), (1.7, 2.2), 3.0, 3.5)
    r1 = rank_stamps(901.3, (901.35, 901.6), (901.7, 902.4), 903.0, 903.4)  # another host
    parts = worker_parts([r0, r1])
    assert parts == pytest.approx({"process_group_s": 0.5, "model_build_s": 0.7,
                                   "diagnostics_s": 0.5})


def test_a_part_one_rank_did_not_stamp_is_absent():
    r0 = rank_stamps(1.0, (1.1, 1.6), (1.7, 2.2), 3.0, 3.5)
    r1 = {k: v for k, v in rank_stamps(1.0, (1.1, 1.6), (1.7, 2.2), 3.0, 3.4).items()
          if k != DONE}  # killed in its traced step: its final result never written
    parts = worker_parts([r0, r1], requested_s=0.9, reaped_s=3.8)
    assert "diagnostics_s" not in parts and "teardown_s" not in parts
    assert parts["model_build_s"] == pytest.approx(0.5)
    assert worker_parts([]) == {}


@pytest.mark.parametrize("seed", range(20))
def test_parts_on_one_clock_never_overlap(seed):
    """Whatever the ranks' skew, the parts lie in order between request and reap: each is
    >= 0, and together they never exceed the launch's span."""
    rng = random.Random(seed)
    requested = 10.0
    ranks = []
    names = [MAIN, *(n for pair in SPANS.values() for n in pair if n != DONE), DONE]
    for _ in range(rng.randint(1, 4)):
        t, stamps = requested, {}
        for name in names:
            t += rng.uniform(0.0, 1.0)
            stamps[name] = t
        ranks.append(stamps)
    reaped = max(r[DONE] for r in ranks) + rng.uniform(0.0, 1.0)
    parts = worker_parts(ranks, requested, reaped)
    assert set(parts) == {"process_start_s", *SPANS, "teardown_s"}
    assert all(v >= 0 for v in parts.values())
    assert sum(parts.values()) <= reaped - requested + 1e-9


def test_unaccounted_closes_the_sum_exactly():
    parts = with_unaccounted({"prepare_s": 0.01, "model_build_s": 0.4, "unaccounted_s": 9.0},
                             wall_s=2.0, timed_s=1.0, warmup_s=0.3)
    assert parts["unaccounted_s"] == pytest.approx(2.0 - 1.0 - 0.3 - 0.41)
    assert sum(parts.values()) == pytest.approx(2.0 - 1.0 - 0.3)


def test_span_stamps_its_end_only_when_the_block_ends():
    stamps: dict[str, float] = {}
    with span(stamps, "model_build"):
        pass
    assert stamps["model_build_start"] <= stamps["model_build_end"]
    with pytest.raises(RuntimeError), span(stamps, "process_group"):
        raise RuntimeError("peer gone")
    assert "process_group_start" in stamps and "process_group_end" not in stamps


# ---- combine: the ranks' files -> the outcome's parts ----------------------------------------

class _Exit:
    returncode = 0


def test_combine_reads_the_ranks_stamps_and_splits_the_slowest_warmup(tmp_path):
    cuda = {"cuda_context_start": 1.05, "cuda_context_end": 1.09}
    RankResult(0, "ok", step_times_s=(0.1,), warmup_time_s=0.5, warmup_first_step_s=0.4,
               stamps_s=rank_stamps(1.0, (1.1, 1.6), (1.7, 2.2), 3.0, 3.5) | cuda,
               ).write(tmp_path / "rank0.json")
    RankResult(1, "ok", step_times_s=(0.2,), warmup_time_s=0.7, warmup_first_step_s=0.6,
               stamps_s=rank_stamps(1.3, (1.35, 1.6), (1.7, 2.4), 3.0, 3.4)
               | {"cuda_context_start": 1.31, "cuda_context_end": 1.34},
               ).write(tmp_path / "rank1.json")
    out = combine(tmp_path, [_Exit(), _Exit()], tmp_path / "worker.log", requested_s=0.9,
                  reaped_s=3.8)
    assert out.status == "ok"
    assert out.parts_s["cuda_context_s"] == pytest.approx(1.34 - 1.31)
    assert out.parts_s["process_start_s"] == pytest.approx(0.4)
    # The warm-up and its first step are one rank's (the slowest), so they add up.
    assert (out.warmup_time_s, out.warmup_first_step_s) == (0.7, 0.6)
    # torchrun's path passes no runner stamps: no process start, no teardown.
    plain = combine(tmp_path, [_Exit(), _Exit()], tmp_path / "worker.log")
    assert "process_start_s" not in plain.parts_s and "teardown_s" not in plain.parts_s


# ---- a real cpu launch -----------------------------------------------------------------------

@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["single", "ddp"])
@pytest.mark.integration
def test_a_cpu_launchs_parts_add_up_to_its_fixed_cost(strategy, cpu_rig, tmp_path, forks):
    case = new_case(cpu_rig, strategy, "toy", 32, 4, measurement=MEASUREMENT)
    out = run_case(CaseSpec(case, cpu_rig), tmp_path, options=LaunchOptions(server=forks))
    assert out.status == "ok", out.reason
    parts = out.parts_s
    fixed = out.wall_time_s - sum(out.step_times_s) - out.warmup_time_s
    assert sum(parts.values()) == pytest.approx(fixed, abs=1e-9)
    must = {"process_start_s", "model_build_s", "diagnostics_s", "teardown_s", "prepare_s",
            "sampler_s", "collect_s"}
    if strategy == "ddp":
        must.add("process_group_s")
    else:
        assert "process_group_s" not in parts  # one process: no group to join
    assert "cuda_context_s" not in parts  # a cpu rig
    assert set(parts) == must | {"unaccounted_s"}
    assert set(parts) <= set(LAUNCH_PARTS)
    assert all(parts[k] > 0 for k in must), parts
    if strategy == "single":  # one rank: the gaps between the parts, never negative
        assert parts["unaccounted_s"] >= 0
    # Most of the fixed cost is named, not left to the rest.
    assert abs(parts["unaccounted_s"]) < 0.5 * fixed, parts
    assert 0 < out.warmup_first_step_s <= out.warmup_time_s


# ---- the cuda path, faked --------------------------------------------------------------------

class _Built(Exception):
    """Raised where the model would be built: the stamps before it are what is tested."""


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """torch.cuda's calls the worker makes before its model, recorded instead of run; the
    model build raises ``_Built``."""
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(worker.torch.cuda, "init", lambda: calls.append(("init", -1)))
    monkeypatch.setattr(worker.torch.cuda, "set_device",
                        lambda i: calls.append(("set_device", int(i))))
    monkeypatch.setattr(worker.torch.cuda, "synchronize",
                        lambda i=None: calls.append(("synchronize", int(i or 0))))
    monkeypatch.setattr(worker, "cap_cuda_memory", lambda devices, cap: None)

    def build(*args: object) -> None:
        raise _Built

    monkeypatch.setattr(worker, "_build", build)
    return calls


@pytest.mark.usefixtures("restore_math_flags")
def test_a_cuda_rank_stamps_its_context_before_the_model(fake_cuda, tmp_path):
    rig = Rig("cuda", 2)
    stamps: dict[str, float] = {}
    with pytest.raises(_Built):
        worker.run_rank(CaseSpec(new_case(rig, "dp", "toy", 32, 4, measurement=MEASUREMENT),
                                 rig), worker.RankPlace(0, 0), tmp_path, stamps=stamps)
    assert stamps["cuda_context_start"] <= stamps["cuda_context_end"]
    assert stamps["cuda_context_end"] <= stamps["model_build_start"]
    assert "model_build_end" not in stamps
    # dp drives both GPUs from one process: a context on each, the first left current.
    assert fake_cuda == [("init", -1), ("set_device", 1), ("synchronize", 1),
                         ("set_device", 0), ("synchronize", 0)]


@pytest.mark.usefixtures("restore_math_flags")
def test_a_cpu_rank_has_no_cuda_stamp(fake_cuda, cpu_rig, tmp_path):
    stamps: dict[str, float] = {}
    with pytest.raises(_Built):
        worker.run_rank(CaseSpec(new_case(cpu_rig, "single", "toy", 32, 4,
                                          measurement=MEASUREMENT), cpu_rig),
                        worker.RankPlace(0, 0), tmp_path, stamps=stamps)
    assert fake_cuda == []
    assert not any(k.startswith("cuda") for k in stamps) and "model_build_start" in stamps


@pytest.mark.usefixtures("restore_math_flags")
def test_a_failed_cuda_rank_writes_the_stamps_it_reached(fake_cuda, tmp_path, monkeypatch):
    """``main`` on a cuda rig whose model build fails: the result file says so and keeps
    the process start's end, the context's span and the last stamp, for the runner."""
    monkeypatch.setattr(worker, "die_with_parent", lambda pid: True)
    rig = Rig("cuda", 1)
    spec = tmp_path / "spec.json"
    CaseSpec(new_case(rig, "single", "toy", 32, 4, measurement=MEASUREMENT), rig).write(spec)
    assert worker.main([str(spec), "0"]) == worker.EXIT_FAILED
    result = RankResult.read(tmp_path / "rank0.json")
    assert result.status == "error" and "_Built" in result.reason
    s = result.stamps_s
    assert s[MAIN] <= s["cuda_context_start"] <= s["cuda_context_end"] <= s[DONE]
    parts = worker_parts([s], requested_s=s[MAIN] - 0.01, reaped_s=s[DONE] + 0.02)
    assert parts["cuda_context_s"] >= 0 and "model_build_s" not in parts
    assert parts["process_start_s"] == pytest.approx(0.01)


# ---- duty.json -------------------------------------------------------------------------------

def _cycle() -> DutyCycle:
    return DutyCycle(wall_s=100.0, timed_s=60.0, warmup_s=15.0, launches_wall_s=90.0,
                     launches=6, calibration_s=4.0,
                     launch_parts_s={"process_start_s": 0.6, "model_build_s": 9.0,
                                     "teardown_s": 3.0, "unaccounted_s": 2.4},
                     warmup_parts_s={"warmup_first_step_s": 12.0, "warmup_steady_s": 3.0},
                     run_parts_s={"collectives_s": 3.0, "calibration_s": 4.0, "other_s": 3.0},
                     estimate_s=80.0)


def test_duty_json_keeps_its_keys_and_adds_the_parts(tmp_path):
    duty = _cycle()
    assert sum(duty.launch_parts_s.values()) == pytest.approx(duty.per_launch_s)
    assert sum(duty.run_parts_s.values()) == pytest.approx(duty.per_run_s)
    assert write_duty(tmp_path, duty) == duty
    d = json.loads((tmp_path / DUTY_FILE).read_text())
    for key in ("wall_s", "timed_s", "warmup_s", "launches_wall_s", "launches", "fixed_s",
                "fixed_per_launch_s", "fixed_per_run_s", "duty_cycle", "calibration_s"):
        assert key in d
    assert d["launch_parts_per_launch_s"]["model_build_s"] == pytest.approx(1.5)
    assert d["estimate_s"] == 80.0
    assert DutyCycle.from_dict(d) == duty
    # A second sitting (--resume) adds its parts to the first's, key by key.
    total = write_duty(tmp_path, DutyCycle(10.0, 5.0, 1.0, 8.0, 1,
                                           launch_parts_s={"model_build_s": 1.0,
                                                           "sampler_s": 0.5}))
    assert total.launch_parts_s["model_build_s"] == pytest.approx(10.0)
    assert total.launch_parts_s["sampler_s"] == pytest.approx(0.5)
    assert total.run_parts_s == duty.run_parts_s and total.launches == 7


@pytest.mark.parametrize("run", ["smoke-1gpu", "smoke-2slots",
                                 "resnet50-224-single-accum"])
def test_the_evidences_older_files_read_without_parts(run):
    d = json.loads((EVIDENCE / run / DUTY_FILE).read_text())
    duty = DutyCycle.from_dict(d)
    assert duty.launch_parts_s == duty.run_parts_s == duty.warmup_parts_s == {}
    assert duty.per_launch_s == pytest.approx(d["fixed_per_launch_s"])
    line = duty.text()
    assert "\n" not in line and "estimated" not in line  # nothing recorded, nothing said


def test_the_end_line_names_the_biggest_parts():
    lines = _cycle().text().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("duty cycle 60% of 100 s: timed steps 60 s; warm-up 15 s")
    assert lines[0].endswith("; estimated 80 s, took 100 s (+25%)")
    assert lines[1] == ("  warm-up: first steps 12 s, steady 3 s; per launch 2.50 s: "
                        "model build 1.50, teardown 0.50, unaccounted 0.40, "
                        "process start 0.10")
    assert lines[2] == "  per run 10 s: calibration 4 s, collectives 3 s, other 3 s"


def test_the_meter_closes_both_sums():
    meter = DutyMeter()
    with meter.part("planning"):
        pass
    meter.set_estimate(42.0)
    with meter.sweep():
        meter.add([0.5, 0.5], 1.0, 4.0, {"model_build_s": 1.5, "unaccounted_s": 0.5}, 0.8)
        meter.add([1.0], 0.5, 3.0, {"model_build_s": 1.0, "unaccounted_s": 0.5}, 0.3)
        meter.add_calibration(2.0)
    duty = meter.finish()
    assert duty.launch_parts_s == {"model_build_s": 2.5, "unaccounted_s": 1.0}
    assert sum(duty.launch_parts_s.values()) == pytest.approx(duty.per_launch_s)
    assert duty.warmup_parts_s == pytest.approx({"warmup_first_step_s": 1.1,
                                                 "warmup_steady_s": 0.4})
    run = duty.run_parts_s
    assert {"planning_s", "calibration_s", "between_launches_s", "other_s"} <= set(run)
    # The meter's wall is real time, so the launches' 7 s and the calibration's 2 s were
    # never spent here: the sweep's remainder and the rest go negative, and still close.
    assert run["between_launches_s"] < 0
    assert sum(run.values()) == pytest.approx(duty.wall_s - duty.launches_wall_s)
    assert duty.estimate_s == 42.0
