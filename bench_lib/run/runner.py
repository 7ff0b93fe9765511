"""Isolated execution of cases: fresh worker process(es) per launch, with a timeout.

Every process of a launch shares one process group of its own, so a crash, hang or OOM
ends that launch alone: on timeout or on a dead rank the whole group is killed, and the
case still yields exactly one row.

Replication (``Measurement.launches`` = L): the cases of one workload (its ``single`` and
every strategy compared with it) are launched in L rounds, each case once per round in a
seeded shuffled order (the same in every run, so a baseline and its candidate match), each
launch a fresh process. The launches' spread is what the case's interval and its speedup's
interval are made of (``measure.stats.launch_interval``; the speedup pairs each round's
launches), so slow drift, a noisy launch and the position in the sweep count as noise, not
as a difference between strategies. The group's rows are written once its last round ends.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from bench_lib.measure.contention import CpuSnapshot, machine_load
from bench_lib.measure.energy import IDLE_SECONDS, IdlePower, idle_power, rig_packages
from bench_lib.measure.flops import AttainablePeak
from bench_lib.measure.sampler import (
    NvmlSource,
    ProcessSource,
    RaplSource,
    Sampler,
    Source,
    UnavailableSource,
    cuda_visible_gpus,
)
from bench_lib.measure.timing import slowest_per_step
from bench_lib.measure.trace import align
from bench_lib.results.store import RunWriter
from bench_lib.rig import Rig
from bench_lib.run.protocol import CaseOutcome, CaseSpec, RankResult, baseline_path
from bench_lib.run.rows import Row, SpeedupTable, case_row, step_rows
from bench_lib.sweep.cases import Case

POLL_S = 0.1
MIB = 2**20
# After one rank dies, its peers get this long to notice and exit before the group is killed.
PEER_GRACE_S = 10.0
LOG_TAIL_CHARS = 400


def _launch(spec_path: Path, nproc: int, log_path: Path) -> list[subprocess.Popen[bytes]]:
    """Start the case's ranks in one new process group (the first rank leads it).

    Each rank is told the runner's pid and asks, as it starts, to be killed when the runner
    dies (``worker.die_with_parent``). Not in a ``preexec_fn``: that runs between fork and
    exec, where a runner that already has threads (progress, CUDA driver) can deadlock the
    child (Python's documented hazard); ``process_group`` needs none.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen[bytes]] = []
    with log_path.open("ab") as log:
        for rank in range(nproc):
            cmd = [sys.executable, "-m", "bench_lib.run.worker", str(spec_path), str(rank),
                   str(os.getpid())]
            group = procs[0].pid if procs else 0  # 0: a new group led by rank 0
            procs.append(
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                 process_group=group)
            )
    return procs


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _describe_exit(rank: int, code: int | None) -> str:
    if code is not None and code < 0:
        return f"rank {rank} was killed by {signal.Signals(-code).name}"
    return f"rank {rank} exited with code {code}"


def _log_tail(log_path: Path) -> str:
    try:
        text = log_path.read_text(errors="replace").strip()
    except OSError:
        return ""
    return " | ".join(text[-LOG_TAIL_CHARS:].splitlines()[-3:])


def _read_baseline_mib(case_dir: Path, rank: int) -> float | None:
    """The resident memory (MiB) a rank recorded before building its model; None before."""
    try:
        return float(json.loads(baseline_path(case_dir, rank).read_text())["rss_mib"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _rss_over_cap(procs: Sequence[subprocess.Popen[bytes]], cap_mib: float, case_dir: Path,
                  devices_per_process: int = 1,
                  baselines: dict[int, float] | None = None) -> str | None:
    """Why a rank holds more resident memory than its devices' cap allows, or None.

    The cap mimics a card of ``cap_mib``: what counts is what the case adds, a rank's
    resident memory (its children's included) net of its footprint before the model was
    built (``protocol.baseline_path``; a rank that has not recorded it yet has built nothing
    and is not checked), and a process that drives k devices (mp, pipeline) gets k caps.
    ``baselines`` caches the recorded footprints between polls.
    """
    known = {} if baselines is None else baselines
    cap = cap_mib * devices_per_process
    for rank, proc in enumerate(procs):
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


def _supervise(
    procs: Sequence[subprocess.Popen[bytes]], timeout_s: float,
    over_cap: Callable[[], str | None] | None = None,
    exited_at: dict[int, float] | None = None,
) -> tuple[str, str] | None:
    """Wait for the ranks; returns (status, reason) when the runner had to stop them.

    ``over_cap`` says why the ranks hold more memory than allowed (they are then an oom).
    ``exited_at`` gets, for each rank that exited on its own (not killed by the runner), the
    wall-clock time (``time.time()``) of the last poll that still saw it running: a lower
    bound of when it ended (0.0 if the first poll found it gone).
    Kills the whole process group whatever happens, including on KeyboardInterrupt.
    """
    pgid = procs[0].pid
    deadline = time.monotonic() + timeout_s
    first_failure: float | None = None
    seen_running = 0.0
    try:
        while True:
            polled = time.time()
            codes = [p.poll() for p in procs]
            if exited_at is not None:
                for rank, code in enumerate(codes):
                    if code is not None and rank not in exited_at:
                        exited_at[rank] = seen_running
            seen_running = polled
            if all(c is not None for c in codes):
                return None
            now = time.monotonic()
            if now > deadline:
                return "timeout", f"case still running after {timeout_s:g} s; killed"
            if over_cap is not None and (reason := over_cap()):
                return "oom", reason
            if first_failure is None and any(c not in (None, 0) for c in codes):
                first_failure = now
            if first_failure is not None and now - first_failure > PEER_GRACE_S:
                return None
            time.sleep(POLL_S)
    finally:
        # Kill the whole group: stuck peers, and any children the ranks started.
        _kill_group(pgid)
        for p in procs:
            p.wait()


def _combine(case_dir: Path, procs: Sequence[subprocess.Popen[bytes]], log_path: Path,
             stopped: tuple[str, str] | None = None,
             exited_at: dict[int, float] | None = None) -> CaseOutcome:
    """Merge the ranks' result files into one outcome.

    Every rank file that exists is read, also when the runner stopped the case
    (``stopped``: ``_supervise``'s status and reason; ``exited_at``: its record of the ranks
    that exited on their own). The outcome, in this order:

    1. A rank failed: the one that failed first is blamed, named in the reason. Failures are
       the ranks that wrote ``oom``/``error`` and those that exited on their own without a
       result (crashed, or killed by a signal that is not the runner's). An ``oom`` is blamed
       before any other failure (a peer's failure makes collectives fail or hang; it never
       allocates), then the earliest: a written failure at ``failed_at_unix_s``, an exit at
       the last poll that saw the rank running (so a peer's error that follows a crash within
       a poll reads as its consequence). Ranks the runner killed without a result were
       waiting for the failed one, and are not blamed.
    2. The runner stopped the case (timeout, or over the memory cap) before every rank had
       written its timed result: that status and reason.
    3. A rank has no result: ``error``.
    4. ``ok``. A rank whose traced step failed, or did not finish (it was stopped in it),
       leaves the case without a timeline, and ``trace_note`` says why.
    """
    exited = exited_at or {}
    results: dict[int, RankResult] = {}
    for rank in range(len(procs)):
        path = case_dir / f"rank{rank}.json"
        if path.exists():
            results[rank] = RankResult.read(path)

    def without_result(rank: int) -> str:
        reason = _describe_exit(rank, procs[rank].returncode) + " without a result"
        tail = _log_tail(log_path)
        return f"{reason}: {tail}" if tail else reason

    def killed(rank: int) -> str:
        code = procs[rank].returncode
        return f" (killed by {signal.Signals(-code).name})" if code is not None and code < 0 else ""

    # (not an oom, when, rank, status, reason) of each failure: the smallest is blamed.
    failures: list[tuple[bool, float, int, str, str]] = [
        (res.status != "oom",
         float("inf") if res.failed_at_unix_s is None else res.failed_at_unix_s,
         rank, res.status, f"rank {rank}: {res.reason}")
        for rank, res in results.items() if res.status != "ok"]
    failures += [(True, exited[rank], rank, "error", without_result(rank))
                 for rank in range(len(procs)) if rank not in results and rank in exited]
    if failures:
        _, _, _, status, reason = min(failures)
        return CaseOutcome(status, reason)
    missing = [rank for rank in range(len(procs)) if rank not in results]
    if stopped is not None and missing:
        return CaseOutcome(*stopped)
    if missing:
        return CaseOutcome("error", without_result(missing[0]))
    notes = [f"rank {rank}: {res.trace_note}{killed(rank)}"
             for rank, res in results.items() if res.trace_note]
    if notes and stopped is not None:
        notes.insert(0, stopped[1])
    trace_note = "no timeline: " + "; ".join(notes) if notes else ""
    per_rank = {r: list(res.step_times_s) for r, res in results.items()}
    windows = [res.timed_window_unix_s for res in results.values() if res.timed_window_unix_s]
    sources = {res.peak_mem_source for res in results.values()}
    return CaseOutcome(
        "ok", step_times_s=slowest_per_step(per_rank), rank_step_times_s=per_rank,
        rank_step_cpu_times_s={r: list(res.step_cpu_times_s) for r, res in results.items()},
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
        # One time axis for all ranks: stamps share the host's monotonic clock. Only a trace
        # every rank finished: part of one would misstate the bubble.
        timeline=[] if notes else align([{"rank": rank, **e} for rank, res in results.items()
                                         for e in res.timeline]),
        traced_step_s=None if notes else max((res.traced_step_s for res in results.values()
                                              if res.traced_step_s is not None), default=None),
        trace_note=trace_note,
    )


def case_sampler(case: Case, rig: Rig, pids: Sequence[int]) -> Sampler:
    """A sampler over the devices a case uses; device labels match peak_mem_mib's keys.

    Where NVML cannot be opened (no library, no driver, a GPU not found) the GPU columns
    stay empty and the sampler's ``note`` says why (for the row's ``sampler_note``).
    """
    sources: list[Source] = []
    interval_s = case.measurement.sample_interval_ms / 1000
    if rig.kind == "cuda":
        try:
            # GPM metrics over at least half an interval: none from the first tick, which
            # comes right after opening.
            sources.append(NvmlSource(_cuda_bus_ids(case.world_size),
                                      gpm_min_span_s=interval_s / 2))
        except Exception as e:  # whatever it was, it is recorded, not swallowed
            sources.append(UnavailableSource("NVML", e))
    else:
        if case.process_group:
            labels = [str(r) for r in range(len(pids))]
        else:  # one process drives every device of the case
            labels = ["+".join(str(i) for i in range(case.world_size))]
        # Each process is pinned to one worker: its CPU % is of that worker's threads.
        threads = dict.fromkeys(labels, rig.threads_per_worker)
        sources.append(ProcessSource(dict(zip(labels, pids)), threads))
        rapl = RaplSource(packages=rig_packages(rig))  # the packages holding the rig's cores
        if rapl.available:
            sources.append(rapl)
    return Sampler(sources, interval_s)


def measure_idle_power(rig: Rig, seconds: float = IDLE_SECONDS) -> IdlePower:
    """The rig's power with nothing of ours running, over the counters cases are read
    through: RAPL of the packages holding a cpu rig's cores, NVML of every GPU of a cuda rig
    (where NVML cannot be opened, ``unsupported`` says why)."""
    sources: list[Source] = []
    described: list[str] = []
    if rig.kind == "cuda":
        try:
            sources.append(NvmlSource(_cuda_bus_ids(rig.num_devices)))
            described += [f"nvml gpu {i}" for i in range(rig.num_devices)]
        except Exception as e:  # no NVML library or driver: no idle figure, and why
            return IdlePower(unsupported=f"NVML unavailable ({type(e).__name__}: {e})")
    else:
        rapl = RaplSource(packages=rig_packages(rig))
        if rapl.available:
            sources.append(rapl)
            described += [f"rapl {d}" for d in rapl.domains]
    return idle_power(sources, described, seconds)


def _cuda_bus_ids(count: int, nvml: Any = None) -> dict[str, str | int]:
    """NVML keys of CUDA devices 0..count-1: PCI bus ids, since CUDA and NVML may order
    GPUs differently (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER).

    Read through NVML alone, so the runner never creates a CUDA context (one would hold
    memory on a GPU the case measures): ``sampler.cuda_visible_gpus`` maps CUDA's visible
    indices to bus ids as CUDA_VISIBLE_DEVICES says, taking CUDA's order as PCI bus order,
    which holds under CUDA_DEVICE_ORDER=PCI_BUS_ID and on machines of identical GPUs (CUDA's
    default FASTEST_FIRST may reorder mixed ones). Raises where NVML cannot be read or sees
    fewer than ``count`` visible GPUs.
    """
    gpus = cuda_visible_gpus(nvml)
    if len(gpus) < count:
        raise RuntimeError(f"NVML sees {len(gpus)} GPU(s) visible to CUDA "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}), "
                           f"the case needs {count}")
    return {str(g.cuda_index): g.bus_id for g in gpus[:count]}


def run_case(case: Case, rig: Rig, work_root: Path, trace: bool = True,
             cut: str = "") -> CaseOutcome:
    """Run one launch of a case in fresh process(es) and return its outcome (never raises
    for the case); ``trace``: trace a step for the pipeline timeline after the timed ones;
    ``cut``: the stage cut to use (``CaseSpec.cut``)."""
    case_dir = work_root / case.case_id
    shutil.rmtree(case_dir, ignore_errors=True)
    case_dir.mkdir(parents=True)
    spec_path = case_dir / "spec.json"
    CaseSpec(case, rig, trace, cut).write(spec_path)
    log_path = case_dir / "worker.log"
    start = time.monotonic()
    cpu_start = CpuSnapshot.now()  # the machine's and our CPU times: contention over the case
    procs = _launch(spec_path, case.processes, log_path)
    # CPU workers are capped here by the resident memory the case adds, per device they
    # drive; GPUs by their allocator (worker.py).
    cap = case.measurement.max_memory_per_device_mib if rig.kind == "cpu" else 0.0
    per_process = 1 if case.process_group else case.world_size
    baselines: dict[int, float] = {}

    def over_cap() -> str | None:
        return _rss_over_cap(procs, cap, case_dir, per_process, baselines)

    exited_at: dict[int, float] = {}
    with case_sampler(case, rig, [p.pid for p in procs]) as sampler:
        stopped = _supervise(procs, case.measurement.case_timeout_s,
                             over_cap if cap else None, exited_at)
    # Every rank has been reaped (_supervise waits for them): their CPU is in our children's.
    load = machine_load(cpu_start, CpuSnapshot.now())
    # The ranks' files, also when the runner stopped them: one may have failed first.
    outcome = _combine(case_dir, procs, log_path, stopped, exited_at)
    outcome.machine_load = load
    outcome.samples = sampler.samples
    outcome.sampler_note = sampler.note
    outcome.wall_time_s = time.monotonic() - start
    if outcome.status == "ok" and not outcome.trace_note:  # else keep worker.log: why
        shutil.rmtree(case_dir, ignore_errors=True)
    return outcome


def round_order(count: int, round_index: int) -> list[int]:
    """The order of a workload's ``count`` cases in round ``round_index``: a shuffle seeded
    by the round alone, so every run of the same sweep launches in the same order."""
    order = list(range(count))
    random.Random(round_index).shuffle(order)
    return order


def workload_groups(cases: list[Case]) -> list[list[int]]:
    """Indices of the cases of each workload (``Case.workload_key``), in first-seen order."""
    groups: dict[tuple[str, int, int, str, str], list[int]] = {}
    for i, case in enumerate(cases):
        groups.setdefault(case.workload_key, []).append(i)
    return list(groups.values())


LaunchStart = Callable[[int, Case, int], None]
"""(case index, case, launch index) as a launch starts."""
LaunchDone = Callable[[int, Case, int, CaseOutcome], None]
"""(case index, case, launch index, the launch's outcome) as it ends."""


def run_sweep(
    cases: list[Case],
    rig: Rig,
    writer: RunWriter,
    on_case_done: Callable[[int, Case, Row], None] | None = None,
    on_launch_start: LaunchStart | None = None,
    attainable_peak: AttainablePeak | None = None,
    idle: IdlePower | None = None,
    on_launch_done: LaunchDone | None = None,
) -> list[Row]:
    """Run every case, workload by workload in rounds of launches (module docstring),
    writing each workload's rows once its last round ends; returns the rows in the order
    written (``cases``' order within a workload: ``single`` first, as ``baselines_first``
    puts it, so its speedups are known when the others' rows are made).

    ``attainable_peak`` is the rig's measured FLOP peak, for the MFU columns; ``idle`` its
    idle power, for the net energy column. A case whose launch fails is not launched again.
    """
    work_root = writer.run_dir / ".work"
    rows = []
    speedups = SpeedupTable()
    speedups.seed(writer.run_dir / "cases.csv")  # a resumed run's earlier `single` rows
    for group in workload_groups(cases):
        launched: dict[int, list[CaseOutcome]] = {i: [] for i in group}
        rounds = max(cases[i].measurement.launches for i in group)
        for r in range(rounds):
            for k in round_order(len(group), r):
                i = group[k]
                case, done = cases[i], launched[group[k]]
                if (case.status is not None or r >= case.measurement.launches
                        or any(o.status != "ok" for o in done)):
                    continue
                if on_launch_start:
                    on_launch_start(i, case, r)
                # Later launches reuse the first launch's cut: the same configuration, and
                # no second profiling of a balanced cut.
                cut = done[0].partition if done else ""
                done.append(run_case(case, rig, work_root, trace=not done, cut=cut))
                if on_launch_done:
                    on_launch_done(i, case, r, done[-1])
        for i in group:
            case = cases[i]
            if case.status is not None:
                outcome = CaseOutcome(case.status, case.reason)
            else:
                outcome = CaseOutcome.of_launches(launched[i])
            row = case_row(case, rig, outcome, attainable_peak, idle)
            speedups.fill(case, row)
            writer.write_case(row, step_rows(outcome), outcome.timeline, samples=outcome.samples)
            rows.append(row)
            if on_case_done:
                on_case_done(i, case, row)
    if work_root.exists() and not any(work_root.iterdir()):
        work_root.rmdir()
    return rows
