"""TEST-ONLY hooks that make a case misbehave on purpose; off unless their variable is set.

A run made with one records it in env.json (``test_hooks``), so it cannot pass as a real
measurement.

* ``PARABENCH_TEST_FAULT=STRATEGY:RANK:KIND`` makes that rank of that strategy's cases
  misbehave just before timing: ``sigkill`` (dies at once), ``hang`` (sleeps forever, so its
  peers block in a collective), ``alloc`` (keeps allocating resident memory), ``oom`` (raises
  ``torch.OutOfMemoryError``, as a GPU that runs out of memory does, while its peers wait for
  it in a collective); in the extra traced step after the timed ones: ``trace-oom``
  (raises ``torch.OutOfMemoryError`` as that step starts; the timed steps are kept); or as
  the diagnostics after the timed steps start (``launch.diagnostics``: in the first one the
  rank runs): ``diag-oom`` (raises ``torch.OutOfMemoryError``), ``diag-hang`` (sleeps
  forever, as a rank waiting in an NCCL collective for a peer that will not come does).
* ``PARABENCH_INJECT_SLOWDOWN=0.15`` makes every timed step do 15% more work, to demonstrate
  the regression gate (benchmarks/regression_gate.py).

RANK ``*`` is every rank of the process that reads the variable: in a multi-node test, the
ranks of the one node whose runner has it set, whichever global ranks the rendezvous gives
them.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import torch

from bench_lib.fault_hooks import INJECT_SLOWDOWN_ENV, TEST_FAULT_ENV
from bench_lib.rig import synchronize

__all__ = ["INJECT_SLOWDOWN_ENV", "TEST_FAULT_ENV", "inject_diagnostics_fault",
           "inject_test_fault", "inject_trace_fault", "with_injected_slowdown"]
FAULT_KINDS = ("sigkill", "hang", "alloc", "oom", "trace-oom", "diag-oom", "diag-hang")
MIB = 2**20


def _fault_kind(strategy: str, rank: int) -> str | None:
    """The fault ``PARABENCH_TEST_FAULT`` asks of this strategy's rank, or None."""
    fault = os.environ.get(TEST_FAULT_ENV, "")
    if fault.count(":") != 2:
        return None
    name, fault_rank, kind = fault.split(":")
    if name != strategy or fault_rank not in ("*", str(rank)):
        return None
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown {TEST_FAULT_ENV} kind {kind!r}; valid: {', '.join(FAULT_KINDS)}")
    return kind


def _simulated_oom(where: str) -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(f"{TEST_FAULT_ENV}: simulated out of memory {where}")


def inject_test_fault(strategy: str, rank: int) -> None:
    """Misbehave as ``PARABENCH_TEST_FAULT`` says, if it names this strategy and rank
    (the kinds that strike before timing; ``inject_trace_fault`` for the traced step,
    ``inject_diagnostics_fault`` for the diagnostics)."""
    kind = _fault_kind(strategy, rank)
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "hang":
        while True:
            time.sleep(1)
    elif kind == "alloc":
        hoard = []
        while True:  # 64 MiB at a time, touched so that it is resident
            hoard.append(b"\x01" * (64 * MIB))
            time.sleep(0.01)
    elif kind == "oom":
        raise _simulated_oom("before timing")


def inject_trace_fault(strategy: str, rank: int) -> None:
    """As the traced step starts: raise ``torch.OutOfMemoryError`` where
    ``PARABENCH_TEST_FAULT`` says ``trace-oom`` for this strategy and rank."""
    if _fault_kind(strategy, rank) == "trace-oom":
        raise _simulated_oom("in the traced step")


def inject_diagnostics_fault(strategy: str, rank: int) -> None:
    """As the diagnostics start: raise ``torch.OutOfMemoryError`` (``diag-oom``) or block
    forever (``diag-hang``) where ``PARABENCH_TEST_FAULT`` says so for this strategy and
    rank."""
    kind = _fault_kind(strategy, rank)
    if kind == "diag-oom":
        raise _simulated_oom("in the diagnostics")
    if kind == "diag-hang":
        while True:
            time.sleep(1)


def with_injected_slowdown(step: Callable[[], None],
                           devices: list[torch.device]) -> Callable[[], None]:
    """``step``, made to do ``PARABENCH_INJECT_SLOWDOWN`` more work when that is set.

    The extra work is a busy loop on the step's own core, not a sleep: on the shared VMs
    we measured on, a process that sleeps part of each step runs the rest faster, so a
    planted 15% sleep showed up as only +8% to +13%.
    """
    fraction = float(os.environ.get(INJECT_SLOWDOWN_ENV) or 0)
    if fraction <= 0:
        return step

    def slow_step() -> None:
        t0 = time.perf_counter()
        step()
        synchronize(devices)  # extra work in proportion to the finished work, not the queued
        end = time.perf_counter() + fraction * (time.perf_counter() - t0)
        while time.perf_counter() < end:
            pass

    return slow_step
