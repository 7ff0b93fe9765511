"""Failures on a multi-GPU box end as the right row, blaming the right rank (issue #14).

- The combiner reads every rank file, also after a timeout: an out-of-memory in one rank is
  the case's ``oom``, not an ``error`` of the peer that was killed waiting for it.
- A failed rank destroys its process group; the worker, not a ``preexec_fn``, arranges to
  die with the runner.
- An out-of-memory in the extra traced step keeps the timed result and says why there is no
  timeline; so does any failure in a diagnostic after the timed steps, which ends the
  diagnostics (a peer may wait for this rank in their collectives) and, past its time
  bound, the rank.

On CPU: faults come through the test-only ``PARABENCH_TEST_FAULT`` hook (``launch.faults``),
the real runs on the cpu rig's gloo groups, with tiny cases.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist

from bench_lib import process_groups
from bench_lib.launch import diagnostics, faults, worker
from bench_lib.launch.protocol import CaseOutcome, CaseSpec, RankResult
from bench_lib.launch.ranks import combine as combine_rank_files
from bench_lib.launch.ranks import launch_ranks
from bench_lib.processes import forkserver, lifeline
from bench_lib.processes.supervision import PEER_GRACE_S
from bench_lib.run.case_launch import run_case
from bench_lib.sweep.cases import new_case
from bench_lib.sweep.profile import Measurement
from tests.conftest import PYTHON, REPO

TIMEOUT_S = 60.0
MEASUREMENT = Measurement(warmup_steps=1, timed_steps=2, max_time_s=30, launches=1,
                          case_timeout_s=TIMEOUT_S)


# ---- the combiner, on rank files written by hand -------------------------------------------


def procs(*codes: int | None) -> list[Any]:
    """Stand-ins for the ranks' Popen objects: only their exit codes are read."""
    return [SimpleNamespace(returncode=c) for c in codes]


def ok(rank: int, note: str = "") -> RankResult:
    return RankResult(rank, "ok", step_times_s=(0.1, 0.2), step_cpu_times_s=(0.1, 0.2),
                      warmup_steps=1, peak_mem_mib={str(rank): 10.0},
                      timeline=({"stage": rank, "start_s": 1.0, "end_s": 2.0},),
                      traced_step_s=0.3, trace_note=note)


def combine(tmp_path: Path, results: list[RankResult], codes: list[int | None],
            **kwargs: Any) -> Any:
    for res in results:
        res.write(tmp_path / f"rank{res.rank}.json")
    return combine_rank_files(tmp_path, procs(*codes), tmp_path / "worker.log", **kwargs)


def test_an_oom_beside_a_rank_killed_waiting_is_that_ranks_oom(tmp_path):
    # Rank 0 blocked in a collective and was killed by the runner after the grace period:
    # no file. Rank 1 ran out of memory.
    oom = RankResult(1, "oom", "out of memory: CUDA out of memory", failed_at_unix_s=100.0)
    out = combine(tmp_path, [oom], [-signal.SIGKILL, 1], exited_at={1: 99.0})
    assert out.status == "oom"
    assert out.reason.startswith("rank 1: out of memory")


def test_of_two_written_failures_the_earlier_is_blamed_and_an_oom_first(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    late = RankResult(0, "error", "RuntimeError: connection closed", failed_at_unix_s=200.0)
    early = RankResult(1, "error", "ValueError: bad shape", failed_at_unix_s=100.0)
    out = combine(tmp_path / "a", [late, early], [1, 1], exited_at={0: 201.0, 1: 101.0})
    assert (out.status, out.reason) == ("error", "rank 1: ValueError: bad shape")
    # An oom is a cause, never a consequence of a peer's failure: blamed even when later.
    first = RankResult(0, "error", "RuntimeError: connection closed", failed_at_unix_s=100.0)
    oom = RankResult(1, "oom", "out of memory: x", failed_at_unix_s=150.0)
    out = combine(tmp_path / "b", [first, oom], [1, 1])
    assert (out.status, out.reason) == ("oom", "rank 1: out of memory: x")


def test_a_rank_that_died_on_its_own_is_blamed_before_the_error_it_caused(tmp_path):
    # Rank 1 was SIGKILLed (not by the runner: it exited before the runner stopped anyone);
    # rank 0's collective then failed and it wrote an error.
    peer = RankResult(0, "error", "RuntimeError: connection closed", failed_at_unix_s=100.05)
    out = combine(tmp_path, [peer], [1, -signal.SIGKILL], exited_at={0: 100.1, 1: 100.0})
    assert out.status == "error"
    assert out.reason.startswith("rank 1 was killed by SIGKILL without a result")


def test_after_a_timeout_an_oom_written_before_is_the_row(tmp_path):
    stopped = ("timeout", "case still running after 60 s; killed")
    oom = RankResult(0, "oom", "out of memory: x", failed_at_unix_s=100.0)
    out = combine(tmp_path, [oom], [-signal.SIGKILL, -signal.SIGKILL], stopped=stopped)
    assert (out.status, out.reason) == ("oom", "rank 0: out of memory: x")


def test_a_timeout_with_no_failure_written_stays_a_timeout(tmp_path):
    stopped = ("timeout", "case still running after 60 s; killed")
    out = combine(tmp_path, [ok(0)], [-signal.SIGKILL, -signal.SIGKILL], stopped=stopped)
    assert (out.status, out.reason) == stopped


def test_a_case_stopped_in_its_traced_step_keeps_its_timed_steps(tmp_path):
    stopped = ("timeout", "case still running after 60 s; killed")
    ranks = [ok(0, "the traced step did not finish"), ok(1, "the traced step did not finish")]
    out = combine(tmp_path, ranks, [-signal.SIGKILL, -signal.SIGKILL], stopped=stopped)
    assert out.status == "ok" and out.step_times_s == [0.1, 0.2]
    assert out.timeline == [] and out.traced_step_s is None
    assert out.trace_note == ("no timeline: case still running after 60 s; killed; "
                              "rank 0: the traced step did not finish (killed by SIGKILL); "
                              "rank 1: the traced step did not finish (killed by SIGKILL)")


def test_a_partial_trace_is_dropped_and_a_full_one_kept(tmp_path):
    (tmp_path / "a").mkdir()
    out = combine(tmp_path / "a", [ok(0, "out of memory in the traced step: x"), ok(1)], [3, 0])
    assert out.status == "ok" and out.timeline == []
    assert out.trace_note == "no timeline: rank 0: out of memory in the traced step: x"
    (tmp_path / "b").mkdir()
    out = combine(tmp_path / "b", [ok(0), ok(1)], [0, 0])
    assert out.trace_note == "" and len(out.timeline) == 2 and out.traced_step_s == 0.3


def test_a_rank_that_lacks_a_diagnostic_costs_the_figures_that_need_every_rank(tmp_path):
    # Rank 0 ran out of memory in its compute-only steps and exited; rank 1 was killed
    # waiting for it in them (NCCL: the broadcast of BatchNorm buffers under no_sync).
    failed = dataclasses.replace(ok(0, "the traced step did not run"), compute_step_s=None,
                                 diagnostics_note="out of memory in the compute-only steps")
    waited = dataclasses.replace(ok(1, "the traced step did not run"), compute_step_s=None,
                                 diagnostics_note="the compute-only steps did not finish")
    out = combine(tmp_path, [failed, waited], [3, -signal.SIGKILL])
    assert out.status == "ok" and out.step_times_s == [0.1, 0.2]
    assert out.diagnostics_note == (
        "diagnostics incomplete: rank 0: out of memory in the compute-only steps; "
        "rank 1: the compute-only steps did not finish (killed by SIGKILL)")
    assert out.compute_step_s is None and out.kernel_names == () and out.timeline == []
    # One rank's figure alone is not the slowest rank's: none, and no kernels of a part.
    (tmp_path / "b").mkdir()
    half = dataclasses.replace(ok(0), compute_step_s=0.5, kernel_names=("gemm",))
    missed = dataclasses.replace(ok(1), diagnostics_note="the kernel-names step failed: x")
    out = combine(tmp_path / "b", [half, missed], [0, 3])
    assert out.compute_step_s is None and out.kernel_names == ()
    (tmp_path / "c").mkdir()
    full = [dataclasses.replace(ok(r), compute_step_s=0.5 + r, kernel_names=("gemm",))
            for r in (0, 1)]
    out = combine(tmp_path / "c", full, [0, 0])
    assert out.diagnostics_note == "" and out.compute_step_s == 1.5
    assert out.kernel_names == ("gemm",)


def test_a_launchs_missing_diagnostic_is_named_in_the_cases_row():
    plain = CaseOutcome("ok", step_times_s=[0.1], warmup_steps=1)
    missed = dataclasses.replace(plain, diagnostics_note="diagnostics incomplete: rank 0: x")
    both = CaseOutcome.of_launches([plain, missed])
    assert both.diagnostics_note == "launch 2: diagnostics incomplete: rank 0: x"
    assert CaseOutcome.of_launches([plain, plain]).diagnostics_note == ""


# ---- the diagnostics, one after another ----------------------------------------------------


def _timed() -> RankResult:
    return RankResult(0, "ok", step_times_s=(0.1,), step_cpu_times_s=(0.1,), warmup_steps=1)


def _diagnostic(what: str, ran: list[str], fail: bool = False,
                traced: bool = False) -> diagnostics.Diagnostic:
    def run(result: RankResult) -> RankResult:
        ran.append(what)
        if fail:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        return dataclasses.replace(result, compute_step_s=0.5) if not traced else result
    return diagnostics.Diagnostic(what, 1, run, traced=traced)


def _never_give_up(result: RankResult) -> Any:
    raise AssertionError(f"gave up: {result}")


def test_a_failed_diagnostic_ends_the_diagnostics_with_the_timed_result_kept():
    """A rank that fails in a diagnostic runs no other (its peers may wait for it in the
    next one's collectives); every result written on the way names the one under way."""
    ran: list[str] = []
    written: list[RankResult] = []
    plan = [_diagnostic(diagnostics.COMPUTE_ONLY, ran, fail=True),
            _diagnostic(diagnostics.KERNELS, ran),
            _diagnostic(diagnostics.TRACED, ran, traced=True)]
    out = diagnostics.run_diagnostics(_timed(), plan, written.append, _never_give_up)
    assert ran == [diagnostics.COMPUTE_ONLY]
    assert out.status == "ok" and out.step_times_s == (0.1,) and out.compute_step_s is None
    assert out.diagnostics_note == (
        "out of memory in the compute-only steps after the timed ones: CUDA out of memory. "
        "Tried to allocate 2 GiB; not run: the kernel-names step")
    assert out.trace_note == "the traced step did not run"
    assert worker.exit_code(out) == worker.EXIT_DIAGNOSTIC_FAILED
    assert [(w.diagnostics_note, w.trace_note) for w in written] == [
        ("the compute-only steps did not finish; not run: the kernel-names step",
         "the traced step did not run")]
    # All well: each written result names the next diagnostic; the last says nothing missed.
    ran.clear()
    written.clear()
    plan = [_diagnostic(diagnostics.COMPUTE_ONLY, ran), _diagnostic(diagnostics.TRACED, ran,
                                                                     traced=True)]
    out = diagnostics.run_diagnostics(_timed(), plan, written.append, _never_give_up)
    assert ran == [diagnostics.COMPUTE_ONLY, diagnostics.TRACED]
    assert (out.compute_step_s, out.diagnostics_note, out.trace_note) == (0.5, "", "")
    assert worker.exit_code(out) == 0
    assert [(w.diagnostics_note, w.trace_note) for w in written] == [
        ("the compute-only steps did not finish", "the traced step did not run"),
        ("", "the traced step did not finish")]


def test_a_diagnostic_past_its_bound_gives_up_with_its_note():
    """In a process group a diagnostic that waits past its bound (a peer that hangs: NCCL
    would wait until its watchdog) hands the rank's result to ``give_up``, which exits."""
    released = threading.Event()
    given: list[RankResult] = []

    def hangs(result: RankResult) -> RankResult:
        assert released.wait(10), "the bound never fired"
        return result

    def give_up(result: RankResult) -> Any:  # the worker's exits; this one lets the test end
        given.append(result)
        released.set()

    plan = [diagnostics.Diagnostic(diagnostics.COMPUTE_ONLY, 2, hangs),
            diagnostics.Diagnostic(diagnostics.TRACED, 1, lambda r: r, traced=True)]
    bounds: list[int] = []

    def bound_s(steps: int) -> float:
        bounds.append(steps)
        return 0.2

    diagnostics.run_diagnostics(_timed(), plan, lambda r: None, give_up, bound_s=bound_s)
    assert bounds[0] == 2  # the bound counts the diagnostic's steps
    assert [(g.diagnostics_note, g.trace_note) for g in given] == [
        ("the compute-only steps did not finish within 0 s", "the traced step did not run")]
    assert diagnostics.time_bound_s(3, slowest_step_s=1.0, first_step_s=4.0) == (
        diagnostics.SLACK_S + 4.0 + diagnostics.STEP_FACTOR * 3)


# ---- the fault hook ------------------------------------------------------------------------


def test_oom_fault_kinds(monkeypatch):
    monkeypatch.setenv(faults.TEST_FAULT_ENV, "ddp:1:oom")
    faults.inject_test_fault("ddp", 0)  # another rank: nothing
    faults.inject_trace_fault("ddp", 1)  # not a traced-step kind: nothing
    with pytest.raises(torch.OutOfMemoryError, match="before timing"):
        faults.inject_test_fault("ddp", 1)
    monkeypatch.setenv(faults.TEST_FAULT_ENV, "gpipe:1:trace-oom")
    faults.inject_test_fault("gpipe", 1)  # strikes in the traced step only
    with pytest.raises(torch.OutOfMemoryError, match="in the traced step"):
        faults.inject_trace_fault("gpipe", 1)
    monkeypatch.setenv(faults.TEST_FAULT_ENV, "ddp:0:diag-oom")
    faults.inject_test_fault("ddp", 0)  # strikes in the diagnostics only
    faults.inject_trace_fault("ddp", 0)
    faults.inject_diagnostics_fault("ddp", 1)  # another rank: nothing
    with pytest.raises(torch.OutOfMemoryError, match="in the diagnostics"):
        faults.inject_diagnostics_fault("ddp", 0)
    monkeypatch.setenv(faults.TEST_FAULT_ENV, "ddp:1:nope")
    with pytest.raises(ValueError, match="valid: .*oom.*trace-oom.*diag-oom.*diag-hang"):
        faults.inject_test_fault("ddp", 1)


# ---- real runs on the cpu rig --------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ddp", "gpipe"])
@pytest.mark.integration
def test_an_oom_rank_gives_an_oom_row_naming_it(strategy, cpu_rig, tmp_path, monkeypatch):
    monkeypatch.setenv(faults.TEST_FAULT_ENV, f"{strategy}:1:oom")
    case = new_case(cpu_rig, strategy, "resnet-tiny", 32, 4, split_size=2,
                    measurement=MEASUREMENT)
    outcome = run_case(CaseSpec(case, cpu_rig), tmp_path)
    assert outcome.status == "oom", outcome.reason
    assert outcome.reason.startswith("rank 1: out of memory"), outcome.reason
    # Ended by the failure (at worst the peer's grace), far from the case timeout.
    assert outcome.wall_time_s < TIMEOUT_S, outcome.wall_time_s


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,rank", [("pipeline", 0), ("gpipe", 1)])
@pytest.mark.integration
def test_an_oom_in_the_traced_step_keeps_the_timed_case(strategy, rank, cpu_rig, tmp_path,
                                                        monkeypatch):
    monkeypatch.setenv(faults.TEST_FAULT_ENV, f"{strategy}:{rank}:trace-oom")
    case = new_case(cpu_rig, strategy, "resnet-tiny", 32, 4, split_size=2,
                    measurement=MEASUREMENT)
    outcome = run_case(CaseSpec(case, cpu_rig, trace=True), tmp_path)
    assert outcome.status == "ok", outcome.reason
    assert len(outcome.step_times_s) == 2 and all(t > 0 for t in outcome.step_times_s)
    assert outcome.timeline == [] and outcome.traced_step_s is None
    assert outcome.trace_note.startswith("no timeline: "), outcome.trace_note
    assert (f"rank {rank}: out of memory in the traced step after the timed ones: "
            f"{faults.TEST_FAULT_ENV}: simulated out of memory in the traced step"
            in outcome.trace_note), outcome.trace_note
    assert outcome.wall_time_s < TIMEOUT_S


# ---- the worker's process group and parent -------------------------------------------------


@pytest.fixture
def solo_group(tmp_path):
    """A one-rank gloo group in this process (on loopback, as the workers' are), destroyed
    afterwards whatever happened, by the real ``destroy_process_group`` (a test may
    replace it)."""
    destroy = dist.destroy_process_group
    before = os.environ.get("GLOO_SOCKET_IFNAME")
    if sys.platform.startswith("linux"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}",
                                rank=0, world_size=1)
        yield
    finally:
        if dist.is_initialized():
            destroy()
        if before is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = before


def test_a_failed_rank_writes_its_result_then_destroys_its_group(tmp_path, monkeypatch,
                                                                 solo_group):
    spec = tmp_path / "spec.json"
    result = tmp_path / "rank0.json"
    seen: list[bool] = []
    destroy = dist.destroy_process_group

    def destroy_and_look(*args: Any, **kwargs: Any) -> None:
        seen.append(result.exists())  # the result is written before the group goes
        destroy(*args, **kwargs)

    def run_rank(*args: Any) -> RankResult:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(worker, "die_with_parent", lambda pid: True)
    monkeypatch.setattr(worker.CaseSpec, "read", classmethod(
        lambda cls, path: SimpleNamespace(case=None, rig=None, trace=True, compute_only=True,
                                          cut="", warmup_steps=None)))
    monkeypatch.setattr(worker, "run_rank", run_rank)
    monkeypatch.setattr(dist, "destroy_process_group", destroy_and_look)
    before = time.time()
    assert worker.main([str(spec), "0"]) == worker.EXIT_FAILED
    assert seen == [True] and not dist.is_initialized()
    written = RankResult.read(result)
    assert written.status == "oom" and written.reason.startswith("out of memory: CUDA")
    assert written.failed_at_unix_s is not None and before <= written.failed_at_unix_s


def test_destroying_a_broken_group_never_raises(monkeypatch, solo_group):
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("NCCL communicator was aborted")

    monkeypatch.setattr(dist, "destroy_process_group", broken)
    process_groups.destroy_process_group(worker.EXIT_FAILED)  # prints the traceback, goes on


def test_the_runner_passes_its_pid_and_no_preexec_fn(tmp_path, monkeypatch):
    started: list[tuple[list[str], dict[str, Any]]] = []

    def popen(cmd: list[str], **kwargs: Any) -> Any:
        started.append((cmd, kwargs))
        return SimpleNamespace(pid=1000 + len(started))

    monkeypatch.setattr(forkserver.subprocess, "Popen", popen)  # no fork server: fresh ones
    launch_ranks(tmp_path / "spec.json", 2, tmp_path / "worker.log")
    assert [cmd[-3:] for cmd, _ in started] == [
        [str(tmp_path / "spec.json"), str(rank), str(os.getpid())] for rank in (0, 1)]
    assert all("preexec_fn" not in kwargs for _, kwargs in started)
    assert [kwargs["process_group"] for _, kwargs in started] == [0, 1001]


def test_die_with_parent_asks_for_sigkill_and_sees_a_dead_parent(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    calls: list[tuple[int, int]] = []

    def prctl(option: int, sig: int) -> int:
        calls.append((option, sig))
        return 0

    assert lifeline.die_with_parent(os.getppid(), prctl) is True
    assert calls == [(lifeline.PR_SET_PDEATHSIG, signal.SIGKILL)]
    # Re-parented (the runner died before prctl): never our own pid's parent.
    assert lifeline.die_with_parent(os.getpid(), prctl) is False


PARENT = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())],
                         stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "armed"
print(child.pid, flush=True)
time.sleep(120)
"""
CHILD = """
import sys, time
from bench_lib.processes.lifeline import die_with_parent
assert die_with_parent(int(sys.argv[1]))
print("armed", flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(60)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.integration
def test_a_worker_dies_when_its_runner_is_sigkilled():
    parent = subprocess.Popen([PYTHON, "-c", PARENT, CHILD], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    child_pid = None
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        child = psutil.Process(child_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the worker outlived its SIGKILLed runner")
    finally:
        parent.kill()
        parent.wait()
        if child_pid is not None and psutil.pid_exists(child_pid):
            try:
                psutil.Process(child_pid).kill()
            except psutil.NoSuchProcess:
                pass


def test_exit_codes_start_the_runners_grace_after_a_failed_diagnostic():
    assert worker.exit_code(ok(0)) == 0
    assert (worker.exit_code(ok(0, "out of memory in the traced step"))
            == worker.EXIT_DIAGNOSTIC_FAILED)
    missed = dataclasses.replace(ok(0), diagnostics_note="the compute-only steps failed: x")
    assert worker.exit_code(missed) == worker.EXIT_DIAGNOSTIC_FAILED
    assert worker.exit_code(RankResult(0, "oom", "x")) == worker.EXIT_FAILED
    # supervision.supervise: a nonzero exit starts the grace
    assert worker.EXIT_DIAGNOSTIC_FAILED != 0
    assert PEER_GRACE_S < TIMEOUT_S
