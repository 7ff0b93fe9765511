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

import psutil

from bench_lib.measure.contention import CpuSnapshot, machine_load
from bench_lib.measure.energy import IDLE_SECONDS, IdlePower, idle_power, rig_packages
from bench_lib.measure.flops import AttainablePeak
from bench_lib.measure.sampler import NvmlSource, ProcessSource, RaplSource, Sampler, Source
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


def _die_with_runner() -> None:
    """In the child before exec: get SIGKILL if the runner dies, so no rank outlives it.

    Linux only (prctl PR_SET_PDEATHSIG); elsewhere the runner's own cleanup has to do.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _launch(spec_path: Path, nproc: int, log_path: Path) -> list[subprocess.Popen[bytes]]:
    """Start the case's ranks in one new process group (the first rank leads it)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen[bytes]] = []
    with log_path.open("ab") as log:
        for rank in range(nproc):
            cmd = [sys.executable, "-m", "bench_lib.run.worker", str(spec_path), str(rank)]
            group = procs[0].pid if procs else 0  # 0: a new group led by rank 0
            procs.append(
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                 process_group=group, preexec_fn=_die_with_runner)
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
) -> tuple[str, str] | None:
    """Wait for the ranks; returns (status, reason) when the runner had to stop them.

    ``over_cap`` says why the ranks hold more memory than allowed (they are then an oom).
    Kills the whole process group whatever happens, including on KeyboardInterrupt.
    """
    pgid = procs[0].pid
    deadline = time.monotonic() + timeout_s
    first_failure: float | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]
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


def _combine(case_dir: Path, procs: Sequence[subprocess.Popen[bytes]],
             log_path: Path) -> CaseOutcome:
    """Merge the ranks' result files into one outcome."""
    results: dict[int, RankResult] = {}
    for rank, proc in enumerate(procs):
        path = case_dir / f"rank{rank}.json"
        if not path.exists():
            reason = _describe_exit(rank, proc.returncode) + " without a result"
            tail = _log_tail(log_path)
            return CaseOutcome("error", f"{reason}: {tail}" if tail else reason)
        results[rank] = RankResult.read(path)
    failed = [r for r in results.values() if r.status != "ok"]
    if failed:
        worst = next((r for r in failed if r.status == "oom"), failed[0])
        return CaseOutcome(worst.status, f"rank {worst.rank}: {worst.reason}")
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
        # One time axis for all ranks: stamps share the host's monotonic clock.
        timeline=align([{"rank": rank, **e} for rank, res in results.items()
                        for e in res.timeline]),
        traced_step_s=max((res.traced_step_s for res in results.values()
                           if res.traced_step_s is not None), default=None),
    )


def case_sampler(case: Case, rig: Rig, pids: Sequence[int]) -> Sampler:
    """A sampler over the devices a case uses; device labels match peak_mem_mib's keys."""
    sources: list[Source] = []
    if rig.kind == "cuda":
        try:
            sources.append(NvmlSource(_cuda_bus_ids(case.world_size)))
        except Exception:  # no NVML library or driver: the GPU columns stay empty
            pass
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
    return Sampler(sources, case.measurement.sample_interval_ms / 1000)


def measure_idle_power(rig: Rig, seconds: float = IDLE_SECONDS) -> IdlePower:
    """The rig's power with nothing of ours running, over the counters cases are read
    through: RAPL of the packages holding a cpu rig's cores, NVML of every GPU of a cuda rig."""
    sources: list[Source] = []
    described: list[str] = []
    if rig.kind == "cuda":
        try:
            sources.append(NvmlSource(_cuda_bus_ids(rig.num_devices)))
            described += [f"nvml gpu {i}" for i in range(rig.num_devices)]
        except Exception:  # no NVML library or driver: no idle figure
            pass
    else:
        rapl = RaplSource(packages=rig_packages(rig))
        if rapl.available:
            sources.append(rapl)
            described += [f"rapl {d}" for d in rapl.domains]
    return idle_power(sources, described, seconds)


def _cuda_bus_ids(count: int) -> dict[str, str | int]:
    """NVML keys of CUDA devices 0..count-1: PCI bus ids, since CUDA and NVML may order
    GPUs differently (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER)."""
    import torch

    keys: dict[str, str | int] = {}
    for i in range(count):
        p = torch.cuda.get_device_properties(i)
        # Present at run time, missing from torch's type stubs.
        domain, bus, dev = (getattr(p, f"pci_{k}_id") for k in ("domain", "bus", "device"))
        keys[str(i)] = f"{domain:08X}:{bus:02X}:{dev:02X}.0"
    return keys


def run_case(case: Case, rig: Rig, work_root: Path, trace: bool = True) -> CaseOutcome:
    """Run one launch of a case in fresh process(es) and return its outcome (never raises
    for the case); ``trace``: trace a step for the pipeline timeline after the timed ones."""
    case_dir = work_root / case.case_id
    shutil.rmtree(case_dir, ignore_errors=True)
    case_dir.mkdir(parents=True)
    spec_path = case_dir / "spec.json"
    CaseSpec(case, rig, trace).write(spec_path)
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

    with case_sampler(case, rig, [p.pid for p in procs]) as sampler:
        stopped = _supervise(procs, case.measurement.case_timeout_s,
                             over_cap if cap else None)
    # Every rank has been reaped (_supervise waits for them): their CPU is in our children's.
    load = machine_load(cpu_start, CpuSnapshot.now())
    outcome = CaseOutcome(*stopped) if stopped else _combine(case_dir, procs, log_path)
    outcome.machine_load = load
    outcome.samples = sampler.samples
    outcome.wall_time_s = time.monotonic() - start
    if outcome.status == "ok":
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
                done.append(run_case(case, rig, work_root, trace=not done))
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
