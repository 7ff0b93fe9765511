"""A rank's diagnostics: what it measures after its timed steps, on the trainer it built.

Compute-only steps (no collective: the bound's compute part), single's optimizer step
alone, the CUDA kernels one more step runs, and one traced step for the pipeline timeline
(``run.worker`` runs them; ``launch_parts`` counts them as the launch's ``diagnostics``).
Each is a derived figure: where it fails, the rank says why and keeps its timed steps.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from bench_lib.measure.kernels import kernel_names
from bench_lib.measure.timing import COMPUTE_ONLY_STEPS
from bench_lib.measure.trace import TracedStep, trace_step
from bench_lib.rig import synchronize
from bench_lib.run.protocol import is_oom
from bench_lib.strategies import Trainer
from bench_lib.strategies.base import TimelineStage

NOTE_CHARS = 300


def compute_only(trainer: Trainer, x: torch.Tensor, y: torch.Tensor,
                 process_group: bool) -> float | None:
    """The median of ``COMPUTE_ONLY_STEPS`` steps run in ``trainer.without_communication``
    (DDP's ``no_sync``: forward, backward and optimizer step, no all-reduce; none with
    SyncBatchNorm, whose forward communicates anyway), timed like a
    timed step, after the timed steps and their memory peaks; None where the strategy has
    no such mode. Every rank starts them together (a barrier), so they share the machine as
    the timed steps did: what remains is this rank's compute, the bound's compute part."""
    if trainer.without_communication() is None:
        return None
    if process_group:
        dist.barrier()
    times = []
    try:  # a derived figure: its failure (out of memory, say) must not cost the timed steps
        for _ in range(COMPUTE_ONLY_STEPS):
            quiet = trainer.without_communication()
            assert quiet is not None
            with quiet:
                synchronize(trainer.devices)
                t0 = time.perf_counter()
                trainer.step(x, y)
                synchronize(trainer.devices)
                times.append(time.perf_counter() - t0)
    except Exception as e:  # no collective follows in these steps: nothing for a peer to wait on
        print(f"compute-only steps failed ({type(e).__name__}: {_first_line(e)}); the bound "
              "falls back on single's share", file=sys.stderr)
        return None
    return statistics.median(times)


OPTIMIZER_STEPS = 3
"""Optimizer steps timed alone after the timed ones (``optimizer_only``)."""


def optimizer_only(trainer: Trainer) -> float | None:
    """The median of ``OPTIMIZER_STEPS`` optimizer steps alone, on the last timed step's
    gradients (the weights move on: nothing is timed after), each between synchronised
    clocks: the share of a step that does not shrink with the batch. None if it fails."""
    times = []
    try:
        for _ in range(OPTIMIZER_STEPS):
            synchronize(trainer.devices)
            t0 = time.perf_counter()
            trainer.optimizer.step()
            synchronize(trainer.devices)
            times.append(time.perf_counter() - t0)
    except Exception as e:  # a derived figure: never worth the timed steps
        print(f"optimizer steps failed ({type(e).__name__}: {_first_line(e)})",
              file=sys.stderr)
        return None
    return statistics.median(times)


def kernels(trainer: Trainer, x: torch.Tensor, y: torch.Tensor,
            process_group: bool) -> tuple[str, ...]:
    """On GPUs, the names of the CUDA kernels one more step runs (``measure.kernels``), so
    the runner can say whether the case's launches ran different ones; () elsewhere (nothing
    is profiled) or where the step fails (a diagnostic: never worth the timed steps). Every
    rank of a group runs it, together (a barrier), as the step's collectives need."""
    if not any(d.type == "cuda" for d in trainer.devices):
        return ()
    try:
        if process_group:
            dist.barrier()
        return kernel_names(lambda: trainer.step(x, y), trainer.devices)
    except Exception as e:
        print(f"the kernel-names step failed ({type(e).__name__}: {_first_line(e)})",
              file=sys.stderr)
        return ()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:NOTE_CHARS] if text else ""


def trace(trainer: Trainer, x: torch.Tensor, y: torch.Tensor, stages: Sequence[TimelineStage],
          slot_labels: list[str], process_group: bool,
          fault: Callable[[], None] = lambda: None,
          rebase: bool = False) -> tuple[TracedStep | None, str]:
    """One extra step after the timed ones, traced for the pipeline timeline; returns it, or
    None and why there is none. Devices are labelled by rig slot (``cpu:1``, ``cuda:1``).

    The step's failure does not throw the timed steps away: out of memory (the traced step
    can need more than the timed ones: its stamps, a first stage's input that needs a
    gradient) or any other exception (in a process group, a peer's failure in the step
    surfaces here as a communication error, whose type depends on the backend) becomes the
    note, and on GPUs the caching allocator's cache is emptied after it. ``fault``: the
    test hook, called as the step starts (``faults.inject_trace_fault``).

    ``rebase`` (ranks on several hosts, whose monotonic clocks have nothing in common): the
    stamps count from the moment this rank left the barrier that starts the step, as its
    peers did within the network's latency, so that the runner can still put every rank
    on one time axis (``trace.align``).
    """

    def step() -> None:
        fault()
        trainer.step(x, y)

    try:
        if process_group:
            dist.barrier()  # the ranks start it together, as they start the timed window
        origin = time.perf_counter()
        traced = trace_step(step, stages, trainer.devices, slot_labels)
        if rebase:
            traced = dataclasses.replace(traced, events=[
                e | {"start_s": e["start_s"] - origin, "end_s": e["end_s"] - origin}
                for e in traced.events])
        return traced, ""
    except Exception as e:  # the traceback goes to the worker log
        if is_oom(e):  # NCCL's, cuDNN's and cuBLAS's too: not only torch.OutOfMemoryError
            note = f"out of memory in the traced step after the timed ones: {_first_line(e)}"
            print(f"traced step: {note}", file=sys.stderr)
        else:
            traceback.print_exc()
            note = f"the traced step failed: {type(e).__name__}: {_first_line(e)}"
    # Out of the handler, the failed step's frames (and the tensors they held) are gone.
    gc.collect()
    if any(d.type == "cuda" for d in trainer.devices):
        # One call empties every device this process allocated on, not only the current
        # one: the caching allocator's emptyCache walks every device's allocator (and the
        # cudaMallocAsync backend trims every initialised device's pool).
        torch.cuda.empty_cache()
    return None, note
