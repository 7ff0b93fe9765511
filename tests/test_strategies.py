"""Every registered strategy gets a smoke test, generated from the registry.

Each runs one real case through the runner (fresh processes, gloo where distributed)
on a tiny model; on a cpu rig a strategy that needs CUDA must say so instead. On two GPUs
the ranks are forked by the fork server, as a run launches them: the tests
``benchmarks/gpu_check.py`` runs there (``gpu_check.plan``, which prices their cases).
"""

from __future__ import annotations

import pytest

from bench_lib import strategies
from bench_lib.gpu_check.plan import TEST_MEASUREMENT as MEASUREMENT
from bench_lib.gpu_check.plan import TWO_GPU_TEST, tiny_case
from bench_lib.launch.protocol import CaseOutcome, CaseSpec
from bench_lib.measure.timing import WARMUP_EXTRA_MAX
from bench_lib.rig import Rig
from bench_lib.rows.rows import case_row
from bench_lib.run.case_launch import LaunchOptions, run_case
from bench_lib.strategies.base import Strategy
from bench_lib.sweep.cases import Case
from bench_lib.sweep.profile import MIN_TIME_S_BY_RIG


@pytest.mark.compat
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", sorted(strategies.REGISTRY))
@pytest.mark.integration
def test_strategy_runs_one_case(name, cpu_rig, tmp_path, forks):
    spec = strategies.get(name)
    reason = spec.unsupported_reason(cpu_rig)
    if reason:
        assert spec.needs_cuda, f"{name} refuses a 2-worker cpu rig: {reason}"
        return
    case = tiny_case(name, cpu_rig)
    assert case.status is None, case.reason
    outcome = run_case(CaseSpec(case, cpu_rig), tmp_path, options=LaunchOptions(server=forks))
    assert outcome.status == "ok", outcome.reason
    assert len(outcome.step_times_s) == 2
    assert all(t > 0 for t in outcome.step_times_s)
    row = case_row(case, cpu_rig, outcome)
    assert row["throughput_img_s"] == pytest.approx(4 / row["step_time_s_median"])
    # The warm-up run, from the ranks through the runner: minimum 1, two to see a trend.
    assert 2 <= row["warmup_steps"] <= 1 + WARMUP_EXTRA_MAX
    assert row["world_size"] == spec.num_devices(cpu_rig)
    assert row["note"], "every strategy says how to read it on a cpu rig"


def _assert_timed_to_the_cuda_minimum(case: Case, outcome: CaseOutcome) -> None:
    """A cuda case's rule (``profile.MIN_TIME_S_BY_RIG``): its ``timed_steps`` (2 here) are a
    floor, not the count; timing goes on until the steps cover the rig's minimum timed
    seconds (3 s, for the sampler's utilisation and energy), judged on the slowest rank's
    steps (``timing.collective_stop``). A tiny model's step takes milliseconds, so the
    minimum, not the step cap, ends it: hundreds of steps on an H100."""
    minimum = case.measurement.min_time_s
    assert minimum == MIN_TIME_S_BY_RIG["cuda"] < MEASUREMENT.max_time_s  # resolved per rig
    assert len(outcome.step_times_s) > MEASUREMENT.timed_steps
    assert all(t > 0 for t in outcome.step_times_s)
    assert sum(outcome.step_times_s) >= minimum, outcome.step_times_s
    assert outcome.stop_reason == "min_time"


def _cuda_rig(devices: int) -> Rig:
    from bench_lib.rig_detection import detect_rig

    return detect_rig("cuda", devices)


def _run_on_cuda(name: str, rig: Rig, tmp_path, server=None) -> None:
    """One tiny case of ``name`` on ``rig`` (its ranks forked by ``server``, else fresh
    interpreters): ok and timed as a cuda case is, or refused for a reason the strategy
    states (never an error row)."""
    spec = strategies.get(name)
    reason = spec.unsupported_reason(rig)
    case = tiny_case(name, rig)
    if reason or case.status is not None:
        assert (reason or case.reason), f"{name} refused {rig.label} without a reason"
        return
    outcome = run_case(CaseSpec(case, rig), tmp_path, options=LaunchOptions(server=server))
    assert outcome.status == "ok", outcome.reason
    _assert_timed_to_the_cuda_minimum(case, outcome)
    row = case_row(case, rig, outcome)
    assert row["peak_mem_source"] == "cuda-allocator"
    assert row["world_size"] == spec.num_devices(rig)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(strategies.REGISTRY))
def test_strategy_runs_one_case_on_one_gpu(name, tmp_path):
    _run_on_cuda(name, _cuda_rig(1), tmp_path)


@pytest.mark.multi_gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(strategies.REGISTRY))
def test_strategy_runs_one_case_on_two_gpus(name, tmp_path, forks):
    """Skipped below two GPUs (conftest says how many it saw); its ranks forked by the
    session's fork server, as a run's."""
    _run_on_cuda(name, _cuda_rig(2), tmp_path, server=forks)


def test_gpu_check_runs_the_two_gpu_tests_by_their_pytest_id():
    assert TWO_GPU_TEST == (f"tests/{__name__.rsplit('.', 1)[-1]}.py::"
                            f"{test_strategy_runs_one_case_on_two_gpus.__name__}")


def test_registry_rejects_duplicates_and_unknown_names():
    with pytest.raises(ValueError, match="already registered; known: .*single"):
        strategies.register(strategies.get("single"))
    with pytest.raises(ValueError, match="unknown strategy 'nope'; valid: .*ddp.*mp"):
        strategies.get("nope")


def test_every_strategy_is_documented():
    for name, spec in strategies.REGISTRY.items():
        assert isinstance(spec, Strategy) and spec.name == name
        assert spec.description
