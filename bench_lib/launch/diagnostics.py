"""A rank's diagnostics: what it measures after its timed steps, on the trainer it built.

Compute-only steps (the bound's compute part), single's optimizer step alone, the CUDA
kernels one more step runs, and one traced step for the pipeline timeline, in that order
(``schedule``; ``launch.worker`` runs them through ``run_diagnostics``, ``launch_parts``
counts them as the launch's ``diagnostics``).

Each is a derived figure, never worth the timed steps, and most use collectives: the
compute-only steps start with a barrier, and DDP's ``no_sync`` steps still broadcast the
BatchNorm buffers from rank 0 in each forward (``broadcast_buffers``); the kernel-names and
traced steps are whole steps, collectives included. So (STYLE 24) a rank writes its timed
result before the first, rewrites it before each naming the one under way, and where one
fails it keeps its timed steps, says why, and runs no other: its peers may be waiting for
it in a collective, which NCCL would leave them in until its watchdog, so the worker exits
nonzero and the runner stops them after its grace period. In a process group each runs
within a time bound (``time_bound_s``), past which the rank gives up the same way: a peer
that hangs costs the diagnostics, not the case.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from bench_lib.launch.protocol import RankResult, is_oom
from bench_lib.measure.kernels import kernel_names
from bench_lib.measure.timing import COMPUTE_ONLY_STEPS
from bench_lib.measure.trace import TracedStep, trace_step
from bench_lib.rig import synchronize
from bench_lib.strategies import Trainer
from bench_lib.strategies.base import TimelineStage

NOTE_CHARS = 300
COMPUTE_ONLY = "the compute-only steps"
OPTIMIZER_ONLY = "the optimizer steps"
KERNELS = "the kernel-names step"
TRACED = "the traced step"
SLACK_S = 10.0
"""A diagnostic's time bound beyond its steps: the barrier's wait for the slowest peer, a
profiler's start (``time_bound_s``)."""
STEP_FACTOR = 3.0
"""A diagnostic's step may take this many times the slowest timed step (a traced or
profiled step does more work than a timed one)."""


@dataclass(frozen=True)
class Diagnostic:
    """One diagnostic: what a note calls it, the steps it runs (its time bound counts them),
    and how it completes the rank's result."""

    what: str
    steps: int
    run: Callable[[RankResult], RankResult]
    traced: bool = False
    """The traced step: its note is the result's ``trace_note`` (no timeline), the others'
    its ``diagnostics_note``."""


def schedule(trainer: Trainer, x: torch.Tensor, y: torch.Tensor, process_group: bool, *,
             compute: bool, optimizer: bool, stages: Sequence[TimelineStage],
             slot_labels: list[str], rebase: bool = False,
             trace_fault: Callable[[], None] = lambda: None) -> list[Diagnostic]:
    """The diagnostics this rank runs, in order: the compute-only steps (``compute``, where
    the strategy has a mode without communication), the optimizer steps (``optimizer``),
    the kernel-names step (GPUs), the traced step (where there are ``stages``). Every rank of
    a group schedules the same ones: they share the case and the rig."""
    plan = []
    if compute and trainer.without_communication() is not None:
        plan.append(Diagnostic(COMPUTE_ONLY, COMPUTE_ONLY_STEPS, lambda r: dataclasses.replace(
            r, compute_step_s=compute_only(trainer, x, y, process_group))))
    if optimizer:
        plan.append(Diagnostic(OPTIMIZER_ONLY, OPTIMIZER_STEPS, lambda r: dataclasses.replace(
            r, optimizer_step_s=optimizer_only(trainer))))
    if any(d.type == "cuda" for d in trainer.devices):
        plan.append(Diagnostic(KERNELS, 1, lambda r: dataclasses.replace(
            r, kernel_names=kernels(trainer, x, y, process_group))))
    if stages:
        def traced(r: RankResult) -> RankResult:
            step = trace(trainer, x, y, stages, slot_labels, process_group, trace_fault, rebase)
            return dataclasses.replace(r, timeline=tuple(step.events), traced_step_s=step.step_s)
        plan.append(Diagnostic(TRACED, 1, traced, traced=True))
    return plan


def time_bound_s(steps: int, slowest_step_s: float, first_step_s: float) -> float:
    """How long a diagnostic of ``steps`` steps may take in a process group: ``SLACK_S``,
    the first warm-up step's time (a step that compiles again pays it again), and
    ``STEP_FACTOR`` times the slowest timed step per step."""
    return SLACK_S + first_step_s + STEP_FACTOR * steps * slowest_step_s


def run_diagnostics(
        result: RankResult, plan: Sequence[Diagnostic], write: Callable[[RankResult], None],
        give_up: Callable[[RankResult], NoReturn],
        bound_s: Callable[[int], float] | None = None,
        fault: Callable[[], None] = lambda: None) -> RankResult:
    """``result`` (the rank's timed result) completed by each diagnostic of ``plan`` in
    turn; the first that fails ends them, with its note (the module docstring says why).

    Before each, ``write`` gets the result so far with a note that it did not finish, so
    that a rank killed in it keeps its timed steps and says which one it was in.
    ``bound_s`` (a process group): a diagnostic of n steps still running after
    ``bound_s(n)`` seconds is abandoned: ``give_up`` gets the result with that note (and
    exits). ``fault``: the test hook, called as the first diagnostic starts
    (``faults.inject_diagnostics_fault``).
    """
    for k, d in enumerate(plan):
        rest = plan[k + 1:]
        write(_noted(result, d, f"{d.what} did not finish", rest))
        limit = None if bound_s is None else bound_s(d.steps)
        late = _noted(result, d, f"{d.what} did not finish within {limit or 0:.0f} s", rest)
        try:
            with _bounded(limit, functools.partial(give_up, late)):
                if k == 0:
                    fault()
                result = d.run(result)
        except Exception as e:  # ends the diagnostics: the traceback goes to the worker log
            return _noted(result, d, _failure_note(d.what, e), rest)
    return result


def _noted(result: RankResult, current: Diagnostic, note: str,
           rest: Sequence[Diagnostic]) -> RankResult:
    """``result`` with ``note`` on ``current`` and the diagnostics after it not run."""
    if current.traced:  # always the last
        return dataclasses.replace(result, trace_note=note)
    skipped = [d.what for d in rest if not d.traced]
    return dataclasses.replace(
        result,
        diagnostics_note=note + (f"; not run: {', '.join(skipped)}" if skipped else ""),
        trace_note=f"{TRACED} did not run" if any(d.traced for d in rest) else "")


@contextmanager
def _bounded(seconds: float | None, give_up: Callable[[], None]) -> Iterator[None]:
    """Run the block; past ``seconds`` (None: no bound), ``give_up`` from a timer thread
    while the block still waits (in a collective, a peer's hang: the main thread holds no
    lock there). A block that ends as the timer fires waits for ``give_up``, which exits."""
    if seconds is None:
        yield
        return
    lock = threading.Lock()
    finished = False

    def expire() -> None:
        with lock:
            if not finished:
                give_up()

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        with lock:
            finished = True
        timer.cancel()


def _failure_note(what: str, e: Exception) -> str:
    """The note of a diagnostic that raised ``e``: out of memory however it came (NCCL's,
    cuDNN's and cuBLAS's too: not only ``torch.OutOfMemoryError``), else its type; the
    traceback goes to the worker log."""
    if is_oom(e):
        note = f"out of memory in {what} after the timed ones: {_first_line(e)}"
        print(f"diagnostics: {note}", file=sys.stderr)
        return note
    traceback.print_exc()
    return f"{what} failed: {type(e).__name__}: {_first_line(e)}"


def compute_only(trainer: Trainer, x: torch.Tensor, y: torch.Tensor,
                 process_group: bool) -> float | None:
    """The median of ``COMPUTE_ONLY_STEPS`` steps run in ``trainer.without_communication``
    (DDP's ``no_sync``: forward, backward and optimizer step, no gradient all-reduce; the
    forward still broadcasts the BatchNorm buffers from rank 0; none with SyncBatchNorm,
    whose forward all-gathers statistics too), timed like a timed step, after the timed
    steps and their memory peaks; None where the strategy has no such mode. Every rank
    starts them together (a barrier), so they share the machine as the timed steps did:
    what remains is this rank's compute, the bound's compute part."""
    if trainer.without_communication() is None:
        return None
    if process_group:
        dist.barrier()
    times = []
    for _ in range(COMPUTE_ONLY_STEPS):
        quiet = trainer.without_communication()
        assert quiet is not None
        with quiet:
            synchronize(trainer.devices)
            t0 = time.perf_counter()
            trainer.step(x, y)
            synchronize(trainer.devices)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


OPTIMIZER_STEPS = 3
"""Optimizer steps timed alone after the timed ones (``optimizer_only``)."""


def optimizer_only(trainer: Trainer) -> float:
    """The median of ``OPTIMIZER_STEPS`` optimizer steps alone, on the last timed step's
    gradients (the weights move on: nothing is timed after), each between synchronised
    clocks: the share of a step that does not shrink with the batch."""
    times = []
    for _ in range(OPTIMIZER_STEPS):
        synchronize(trainer.devices)
        t0 = time.perf_counter()
        trainer.optimizer.step()
        synchronize(trainer.devices)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernels(trainer: Trainer, x: torch.Tensor, y: torch.Tensor,
            process_group: bool) -> tuple[str, ...]:
    """On GPUs, the names of the CUDA kernels one more step runs (``measure.kernels``), so
    the runner can say whether the case's launches ran different ones; () elsewhere
    (nothing is profiled). Every rank of a group runs it, together (a barrier), as the
    step's collectives need."""
    if not any(d.type == "cuda" for d in trainer.devices):
        return ()
    if process_group:
        dist.barrier()
    return kernel_names(lambda: trainer.step(x, y), trainer.devices)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:NOTE_CHARS] if text else ""


def trace(trainer: Trainer, x: torch.Tensor, y: torch.Tensor, stages: Sequence[TimelineStage],
          slot_labels: list[str], process_group: bool,
          fault: Callable[[], None] = lambda: None,
          rebase: bool = False) -> TracedStep:
    """One extra step after the timed ones, traced for the pipeline timeline. Devices are
    labelled by rig slot (``cpu:1``, ``cuda:1``). It can need more memory than the timed
    steps (its stamps, a first stage's input that needs a gradient). ``fault``: the test
    hook, called as the step starts (``faults.inject_trace_fault``).

    ``rebase`` (ranks on several hosts, whose monotonic clocks have nothing in common): the
    stamps count from the moment this rank left the barrier that starts the step, as its
    peers did within the network's latency, so that the runner can still put every rank
    on one time axis (``trace.align``).
    """

    def step() -> None:
        fault()
        trainer.step(x, y)

    if process_group:
        dist.barrier()  # the ranks start it together, as they start the timed window
    origin = time.perf_counter()
    traced = trace_step(step, stages, trainer.devices, slot_labels)
    if rebase:
        traced = dataclasses.replace(traced, events=[
            e | {"start_s": e["start_s"] - origin, "end_s": e["end_s"] - origin}
            for e in traced.events])
    return traced
