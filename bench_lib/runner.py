"""Isolated execution of cases: fresh worker process(es) per case, with a timeout.

Every process of a case shares one process group of its own, so a crash, hang or OOM
ends that case alone: on timeout or on a dead rank the whole group is killed, and the
case still yields exactly one row.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bench_lib import strategies
from bench_lib.measures import SpeedupTable, case_sampler, summary_columns
from bench_lib.results import RunWriter, write_json_atomic
from bench_lib.rig import Rig
from bench_lib.stats import Stats
from bench_lib.sweep import Case
from bench_lib.timeline import align

POLL_S = 0.1
MIB = 2**20
# After one rank dies, its peers get this long to notice and exit before the group is killed.
PEER_GRACE_S = 10.0
LOG_TAIL_CHARS = 400


@dataclass
class CaseOutcome:
    """What happened to one case."""

    status: str
    reason: str = ""
    step_times_s: list[float] = field(default_factory=list)
    """Per timed step, the slowest rank's time."""
    rank_step_times_s: dict[int, list[float]] = field(default_factory=dict)
    peak_mem_mib: dict[str, float] = field(default_factory=dict)
    wall_time_s: float = 0.0
    timeline: list[dict] = field(default_factory=list)
    """Pipeline timeline rows of the traced step (timeline.csv), every rank's."""
    partition: str = ""
    """The stage cut the ranks used, e.g. ``balanced:8`` (strategies that cut the model)."""
    peak_mem_reserved_mib: dict[str, float] = field(default_factory=dict)
    """CUDA caching allocator's peak reservation per device (empty on CPU)."""
    window: list[float] = field(default_factory=list)
    """Wall-clock (unix s) start and end of the timed window, over all ranks."""
    stop_reason: str = ""
    """Which stop ended timing: ci_target, time_cap or step_cap (rank 0's; ranks agree)."""
    samples: list[dict] = field(default_factory=list)
    """The sampler's rows (samples.csv) over the whole case."""


def _die_with_runner() -> None:
    """In the child before exec: get SIGKILL if the runner dies, so no rank outlives it.

    Linux only (prctl PR_SET_PDEATHSIG); elsewhere the runner's own cleanup has to do.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _launch(spec_path: Path, nproc: int, log_path: Path) -> list[subprocess.Popen]:
    """Start the case's ranks in one new process group (the first rank leads it)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen] = []
    with log_path.open("ab") as log:
        for rank in range(nproc):
            cmd = [sys.executable, "-m", "bench_lib.worker", str(spec_path), str(rank)]
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


def _describe_exit(rank: int, code: int) -> str:
    if code < 0:
        return f"rank {rank} was killed by {signal.Signals(-code).name}"
    return f"rank {rank} exited with code {code}"


def _log_tail(log_path: Path) -> str:
    try:
        text = log_path.read_text(errors="replace").strip()
    except OSError:
        return ""
    return " | ".join(text[-LOG_TAIL_CHARS:].splitlines()[-3:])


def _rss_over_cap(procs: list[subprocess.Popen], cap_mib: float) -> str | None:
    """Why a rank (with its children) holds more resident memory than ``cap_mib``, or None."""
    for rank, proc in enumerate(procs):
        try:
            parent = psutil.Process(proc.pid)
            rss = sum(p.memory_info().rss for p in [parent, *parent.children(recursive=True)])
        except psutil.Error:  # exited between the poll and now
            continue
        if rss / MIB > cap_mib:
            return (f"rank {rank} held {rss / MIB:.0f} MiB resident, over the "
                    f"{cap_mib:.0f} MiB cap (--max-memory-per-device); killed")
    return None


def _supervise(
    procs: list[subprocess.Popen], timeout_s: float, max_rss_mib: float = 0.0
) -> tuple[str, str] | None:
    """Wait for the ranks; returns (status, reason) when the runner had to stop them.

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
            if max_rss_mib and (reason := _rss_over_cap(procs, max_rss_mib)):
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


def _combine(case_dir: Path, procs: list[subprocess.Popen], log_path: Path) -> CaseOutcome:
    """Merge the ranks' result files into one outcome."""
    results = {}
    for rank, proc in enumerate(procs):
        path = case_dir / f"rank{rank}.json"
        if path.exists():
            results[rank] = json.loads(path.read_text())
        else:
            reason = _describe_exit(rank, proc.returncode) + " without a result"
            tail = _log_tail(log_path)
            return CaseOutcome("error", f"{reason}: {tail}" if tail else reason)
    failed = [r for r in results.values() if r["status"] != "ok"]
    if failed:
        worst = next((r for r in failed if r["status"] == "oom"), failed[0])
        return CaseOutcome(worst["status"], f"rank {worst['rank']}: {worst.get('reason', '')}")
    per_rank = {r: res["step_times_s"] for r, res in results.items()}
    slowest = [max(step) for step in zip(*per_rank.values())]
    peak = {k: v for res in results.values() for k, v in res["peak_mem_mib"].items()}
    timeline = align([{"rank": rank, **e} for rank, res in results.items()
                      for e in res.get("timeline", [])])  # one time axis for all ranks
    reserved = {k: v for res in results.values()
                for k, v in res.get("peak_mem_reserved_mib", {}).items()}
    windows = [res["timed_window_unix_s"] for res in results.values()
               if len(res.get("timed_window_unix_s", [])) == 2]
    window = [min(w[0] for w in windows), max(w[1] for w in windows)] if windows else []
    return CaseOutcome("ok", "", slowest, per_rank, peak, timeline=timeline,
                       peak_mem_reserved_mib=reserved, window=window,
                       stop_reason=results[0].get("stop_reason", ""),
                       partition=results[0].get("partition", ""))


def run_case(case: Case, rig: Rig, work_root: Path) -> CaseOutcome:
    """Run one case in fresh process(es) and return its outcome (never raises for the case)."""
    spec = strategies.get(case.strategy)
    nproc = spec.num_devices(rig) if spec.per_device_processes else 1
    case_dir = work_root / case.case_id
    shutil.rmtree(case_dir, ignore_errors=True)
    case_dir.mkdir(parents=True)
    spec_path = case_dir / "spec.json"
    write_json_atomic(spec_path, {"case": case.as_dict(), "rig": rig.as_dict()})
    log_path = case_dir / "worker.log"
    start = time.monotonic()
    procs = _launch(spec_path, nproc, log_path)
    # CPU workers are capped here by resident memory; GPUs by their allocator (worker.py).
    cap = case.settings.get("max_memory_per_device_mib", 0.0) if rig.kind == "cpu" else 0.0
    with case_sampler(case, rig, [p.pid for p in procs]) as sampler:
        stopped = _supervise(procs, case.settings["case_timeout_s"], cap)
    if stopped:
        outcome = CaseOutcome(*stopped)
    else:
        outcome = _combine(case_dir, procs, log_path)
    outcome.samples = sampler.samples
    outcome.wall_time_s = time.monotonic() - start
    if outcome.status == "ok":
        shutil.rmtree(case_dir, ignore_errors=True)
    return outcome


def case_row(case: Case, rig: Rig, outcome: CaseOutcome, peak: dict | None = None) -> dict:
    """The cases.csv row of a case."""
    spec = strategies.get(case.strategy)
    row = {
        "case_id": case.case_id,
        "strategy": case.strategy,
        "model": case.model,
        "rig": rig.label,
        "world_size": spec.num_devices(rig),
        "threads_per_worker": rig.threads_per_worker if rig.kind == "cpu" else "",
        "image_size": case.image_size,
        "batch_size": case.batch_size,
        "split_size": "" if case.split_size is None else case.split_size,
        "num_microbatches": case.num_microbatches or "",
        "precision": case.precision,
        "loss": case.loss,
        "status": outcome.status,
        "reason": outcome.reason,
        "warmup_steps": case.settings.get("warmup_steps", ""),
        "note": spec.cpu_note if rig.kind == "cpu" else "",
        # The cut actually used (with its block indices) once run; the asked-for method before.
        "partition": outcome.partition or case.partition or "",
        "channels_last": int(case.channels_last),
        "compile": int(case.compile),
        "sync_bn": int(case.sync_bn),
    }
    if outcome.status == "ok":
        s = Stats.of(outcome.step_times_s)
        row |= {
            "timed_steps": s.n,
            "step_time_s_median": s.median,
            "step_time_s_mean": s.mean,
            "step_time_s_stdev": s.stdev,
            "step_time_s_p10": s.p10,
            "step_time_s_p90": s.p90,
            "step_time_s_iqr": s.iqr,
            "step_time_s_ci_low": s.ci_low,
            "step_time_s_ci_high": s.ci_high,
            "throughput_img_s": case.batch_size / s.median,
            "peak_mem_mib_max": max(outcome.peak_mem_mib.values()),
            "peak_mem_mib_by_device": ";".join(
                f"{k}:{v:.1f}" for k, v in sorted(outcome.peak_mem_mib.items())
            ),
            "case_wall_time_s": round(outcome.wall_time_s, 3),
        }
        row |= summary_columns(case, rig, outcome, peak)
    elif outcome.wall_time_s:
        row["case_wall_time_s"] = round(outcome.wall_time_s, 3)
    return row


def step_rows(outcome: CaseOutcome) -> list[dict]:
    return [
        {"rank": rank, "step": i, "step_time_s": t}
        for rank, times in sorted(outcome.rank_step_times_s.items())
        for i, t in enumerate(times)
    ]


def run_sweep(
    cases: list[Case],
    rig: Rig,
    writer: RunWriter,
    on_case_done: Callable[[int, Case, dict], None] | None = None,
    on_case_start: Callable[[int, Case], None] | None = None,
    peak: dict | None = None,
) -> list[dict]:
    """Run every case in order, writing its row as soon as it ends; returns the rows.

    ``peak`` is the rig's attainable peak (``flops.measure_peak``) for the MFU columns.
    """
    work_root = writer.run_dir / ".work"
    rows = []
    speedups = SpeedupTable()
    speedups.seed(writer.run_dir / "cases.csv")  # a resumed run's earlier `single` rows
    for i, case in enumerate(cases):
        if on_case_start:
            on_case_start(i, case)
        if case.status is not None:
            outcome = CaseOutcome(case.status, case.reason)
        else:
            outcome = run_case(case, rig, work_root)
        row = case_row(case, rig, outcome, peak)
        speedups.fill(case, row)
        writer.write_case(row, step_rows(outcome), outcome.timeline, samples=outcome.samples)
        rows.append(row)
        if on_case_done:
            on_case_done(i, case, row)
    if work_root.exists() and not any(work_root.iterdir()):
        work_root.rmdir()
    return rows
