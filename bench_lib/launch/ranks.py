"""A launch's ranks: started in one process group of their own (``launch_ranks``, through
``processes.supervision.start_group``), their memory checked against the cpu cap
(``rss_over_cap``, for ``supervision.supervise``), and their result files combined into one
``CaseOutcome`` by the runner's rules (the first failure blamed, an ``oom`` first; else the
slowest rank per step). The runner's launches (``run.case_launch``, ``run.agent_launch``), the
calibration (``prediction.calibration``) and the distance command (``distance.launch``) start and
read their ranks through it.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import psutil

from bench_lib.analysis.stats import slowest_per_step
from bench_lib.launch.agent import WORKER_MODULE
from bench_lib.launch.launch_parts import worker_parts
from bench_lib.launch.protocol import CaseOutcome, RankResult, baseline_path, is_oom
from bench_lib.launch.torchrun import TORCHRUN_SUMMARY
from bench_lib.measure.trace import align
from bench_lib.processes.forkserver import ForkServer
from bench_lib.processes.supervision import Rank, start_group

MIB = 2**20
LOG_TAIL_CHARS = 400


def launch_ranks(spec_path: Path, nproc: int, log_path: Path,
                 server: ForkServer | None = None, module: str = WORKER_MODULE) -> list[Rank]:
    """Start a launch's ranks, ``python -m MODULE SPEC_JSON RANK PARENT_PID`` (the case
    worker; the distance worker takes the same arguments), in one new process group (the
    first rank leads it): forked by ``server`` (``processes.forkserver``: no seconds of imports
    per rank), else each a fresh interpreter.

    Each rank is told its parent's pid (the runner's, or the server's) and asks, as it
    starts, to be killed when that parent dies (``lifeline.die_with_parent``). Not in a
    ``preexec_fn``: that runs between fork and exec, where a runner that already has threads
    (progress, CUDA driver) can deadlock the child (Python's documented hazard);
    ``process_group`` needs none.
    """
    parent = server.ensure() if server is not None else os.getpid()
    args = [[str(spec_path), str(rank), str(parent)] for rank in range(nproc)]
    return start_group(server, module, args, log_path)


def _describe_exit(rank: int, code: int | None) -> str:
    if code is None:  # under torchrun: a rank the agent's failure summary does not name
        return f"rank {rank} ended"
    if code < 0:
        return f"rank {rank} was killed by {signal.Signals(-code).name}"
    return f"rank {rank} exited with code {code}"


def log_tail(log_path: Path) -> str:
    """The log's last lines, for a reason; under torchrun, those before the agent's own
    traceback and failure summary (``torchrun.failure_codes`` reads that)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return ""
    if TORCHRUN_SUMMARY in text:
        text = text[:text.rfind("Traceback (most recent call last)", 0,
                                text.index(TORCHRUN_SUMMARY))]
    text = text.strip()
    return " | ".join(text[-LOG_TAIL_CHARS:].splitlines()[-3:])


def _read_baseline_mib(case_dir: Path, rank: int) -> float | None:
    """The resident memory (MiB) a rank recorded before building its model; None before."""
    try:
        return float(json.loads(baseline_path(case_dir, rank).read_text())["rss_mib"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class _HasPid(Protocol):
    @property
    def pid(self) -> int: ...


class _Ended(Protocol):
    @property
    def returncode(self) -> int | None: ...


def rss_over_cap(procs: Sequence[_HasPid] | Mapping[int, _HasPid], cap_mib: float,
                  case_dir: Path, devices_per_process: int = 1,
                  baselines: dict[int, float] | None = None) -> str | None:
    """Why a rank holds more resident memory than its devices' cap allows, or None.

    The cap mimics a card of ``cap_mib``: what counts is what the case adds, a rank's
    resident memory (its children's included) net of its footprint before the model was
    built (``protocol.baseline_path``; a rank that has not recorded it yet has built nothing
    and is not checked), and a process that drives k devices (mp, pipeline) gets k caps.
    ``baselines`` caches the recorded footprints between polls. ``procs``: the ranks in
    rank order, or by rank (under torchrun, those found on this node).
    """
    known = {} if baselines is None else baselines
    cap = cap_mib * devices_per_process
    for rank, proc in procs.items() if isinstance(procs, Mapping) else enumerate(procs):
        if rank not in known:
            base = _read_baseline_mib(case_dir, rank)
            if base is None:
                continue
            known[rank] = base
        try:
            parent = psutil.Process(proc.pid)
            rss = sum(p.memory_info().rss for p in [parent, *parent.children(recursive=True)])
        except psutil.Error:  # exited between the poll and now
            continue
        added = rss / MIB - known[rank]
        if added > cap:
            per = (f" ({devices_per_process} devices x {cap_mib:.0f} MiB)"
                   if devices_per_process > 1 else "")
            return (f"rank {rank} held {added:.0f} MiB resident beyond its "
                    f"{known[rank]:.0f} MiB runtime, over the {cap:.0f} MiB cap{per} "
                    "(--max-memory-per-device); killed")
    return None


def combine(case_dir: Path, procs: Sequence[_Ended], log_path: Path,
             stopped: tuple[str, str] | None = None,
             exited_at: dict[int, float] | None = None, requested_s: float | None = None,
             reaped_s: float | None = None) -> CaseOutcome:
    """Merge the ranks' result files into one outcome.

    Every rank file that exists is read, also when the runner stopped the case
    (``stopped``: ``supervise``'s status and reason; ``exited_at``: its record of the ranks
    that exited on their own). The outcome, in this order:

    1. A rank failed: the one that failed first is blamed, named in the reason. Failures are
       the ranks that wrote ``oom``/``error`` and those that exited on their own without a
       result (crashed, or killed by a signal that is not the runner's: an ``oom`` where the
       log's tail says the memory ran out, ``protocol.is_oom``). An ``oom`` is blamed
       before any other failure (a peer's failure makes collectives fail or hang; it never
       allocates), then the earliest: a written failure at ``failed_at_unix_s``, an exit at
       the last poll that saw the rank running (so a peer's error that follows a crash within
       a poll reads as its consequence). Ranks the runner killed without a result were
       waiting for the failed one, and are not blamed.
    2. The runner stopped the case (timeout, or over the memory cap) before every rank had
       written its timed result: that status and reason.
    3. A rank has no result: ``error`` (``oom`` where the log's tail says so).
    4. ``ok``. A rank whose traced step failed, or did not finish (it was stopped in it),
       leaves the case without a timeline, and ``trace_note`` says why; a rank that lacks
       another diagnostic leaves out the figures that need every rank's (the compute-only
       step, the kernels), and ``diagnostics_note`` says why.

    ``procs``: one per rank, only their exit codes are read (None: not known).

    Whatever the outcome, where every rank wrote a result, ``parts_s`` holds the launch's
    parts from their stamps (``launch_parts.worker_parts``; ``requested_s``, ``reaped_s``:
    the runner's monotonic stamps as it asked for the first rank and had reaped the last,
    None where it has none: torchrun).
    """
    exited = exited_at or {}
    results: dict[int, RankResult] = {}
    for rank in range(len(procs)):
        path = case_dir / f"rank{rank}.json"
        if path.exists():
            results[rank] = RankResult.read(path)
    parts = (worker_parts([results[r].stamps_s for r in range(len(procs))], requested_s,
                          reaped_s) if len(results) == len(procs) else {})

    def without_result(rank: int) -> tuple[str, str]:
        """Its status and reason: ``oom`` where the log's tail says so (NCCL's watchdog
        aborts a rank on an asynchronous CUDA error, before it writes anything)."""
        reason = _describe_exit(rank, procs[rank].returncode) + " without a result"
        tail = log_tail(log_path)
        return ("oom" if is_oom(tail) else "error"), (f"{reason}: {tail}" if tail else reason)

    def killed(rank: int) -> str:
        code = procs[rank].returncode
        return f" (killed by {signal.Signals(-code).name})" if code is not None and code < 0 else ""

    # (not an oom, when, rank, status, reason) of each failure: the smallest is blamed.
    failures: list[tuple[bool, float, int, str, str]] = [
        (res.status != "oom",
         float("inf") if res.failed_at_unix_s is None else res.failed_at_unix_s,
         rank, res.status, f"rank {rank}: {res.reason}")
        for rank, res in results.items() if res.status != "ok"]
    failures += [(status != "oom", exited[rank], rank, status, reason)
                 for rank in range(len(procs)) if rank not in results and rank in exited
                 for status, reason in [without_result(rank)]]
    if failures:
        _, _, _, status, reason = min(failures)
        return CaseOutcome(status, reason, parts_s=parts)
    missing = [rank for rank in range(len(procs)) if rank not in results]
    if stopped is not None and missing:
        return CaseOutcome(*stopped)
    if missing:
        return CaseOutcome(*without_result(missing[0]))
    notes = [f"rank {rank}: {res.trace_note}{killed(rank)}"
             for rank, res in results.items() if res.trace_note]
    if notes and stopped is not None:
        notes.insert(0, stopped[1])
    trace_note = "no timeline: " + "; ".join(notes) if notes else ""
    missed = [f"rank {rank}: {res.diagnostics_note}{killed(rank)}"
              for rank, res in results.items() if res.diagnostics_note]
    if missed and stopped is not None and not notes:
        missed.insert(0, stopped[1])
    computed = [res.compute_step_s for res in results.values()]
    per_rank = {r: list(res.step_times_s) for r, res in results.items()}
    windows = [res.timed_window_unix_s for res in results.values() if res.timed_window_unix_s]
    sources = {res.peak_mem_source for res in results.values()}
    slowest_warmup = max(results.values(), key=lambda res: res.warmup_time_s)
    return CaseOutcome(
        "ok", step_times_s=slowest_per_step(per_rank), rank_step_times_s=per_rank,
        rank_step_cpu_times_s={r: list(res.step_cpu_times_s) for r, res in results.items()},
        rank_probe_times_s={r: list(res.probe_times_s) for r, res in results.items()
                            if res.probe_times_s},
        peak_mem_mib={k: v for res in results.values() for k, v in res.peak_mem_mib.items()},
        peak_mem_net_mib={k: v for res in results.values()
                          for k, v in res.peak_mem_net_mib.items()},
        # ru_maxrss (a lifetime peak) if any rank could not reset its peak after warm-up.
        peak_mem_source=("ru_maxrss" if "ru_maxrss" in sources else results[0].peak_mem_source),
        peak_mem_reserved_mib={k: v for res in results.values()
                               for k, v in res.peak_mem_reserved_mib.items()},
        timed_window_unix_s=((min(w[0] for w in windows), max(w[1] for w in windows))
                             if windows else None),
        stop_reason=results[0].stop_reason, partition=results[0].partition,
        warmup_steps=results[0].warmup_steps,
        warmup_time_s=slowest_warmup.warmup_time_s,
        # Its split from the same rank: the two parts add up to the warm-up.
        warmup_first_step_s=slowest_warmup.warmup_first_step_s, parts_s=parts,
        # One time axis for all ranks: stamps share the host's monotonic clock (across nodes,
        # each rank's counts from the barrier that starts the step: diagnostics.trace). Only a
        # trace every rank finished: part of one would misstate the bubble.
        timeline=[] if notes else align([{"rank": rank, **e} for rank, res in results.items()
                                         for e in res.timeline]),
        traced_step_s=None if notes else max((res.traced_step_s for res in results.values()
                                              if res.traced_step_s is not None), default=None),
        # The slowest rank's, where every rank measured it (a rank without it may be the
        # slowest).
        compute_step_s=(None if None in computed
                        else max(c for c in computed if c is not None)),
        optimizer_step_s=max((res.optimizer_step_s for res in results.values()
                              if res.optimizer_step_s is not None), default=None),
        trace_note=trace_note,
        diagnostics_note="diagnostics incomplete: " + "; ".join(missed) if missed else "",
        kernel_names=() if missed else tuple(sorted({k for res in results.values()
                                                     for k in res.kernel_names})),
    )
