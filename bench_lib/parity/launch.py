"""Launching parity runs: each in fresh rank processes (``python -m bench_lib.parity.train``)
in a process group of their own, supervised as a case's ranks are
(``processes.supervision``), with a time limit; on a cpu rig the one-process runs side by
side.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench_lib.launch.agent import WARM_MODULES
from bench_lib.parity.train import EpochResult, ParitySpec, result_path
from bench_lib.processes.forkserver import ForkServer
from bench_lib.processes.supervision import start_group, supervise
from bench_lib.rig import Rig

RUN_TIMEOUT_S = 600.0
PEER_GRACE_S = 0.5
"""After one rank fails, how long its peers get to fail on their own before the group is
killed: a parity run's verdict reads the first error alone, so no longer than a moment."""
Outcome = tuple[list[EpochResult], str]
"""A run's epochs, or none and why."""


@dataclass(frozen=True)
class Job:
    """One training run to launch."""

    spec: ParitySpec
    workdir: Path
    """Its own folder: the spec, the ranks' log, their result or errors."""
    processes: int
    """Rank processes (1: one process drives the strategy's devices)."""


def launch(spec: ParitySpec, workdir: Path, processes: int,
           server: ForkServer | None = None) -> tuple[list[EpochResult], str]:
    """Run ``spec`` in fresh rank processes (forked by ``server`` where given); its epochs,
    or none and why. Past ``RUN_TIMEOUT_S``, or ``PEER_GRACE_S`` after a rank failed, the
    ranks' process group is killed."""
    workdir.mkdir(parents=True)
    spec.write(workdir / "spec.json")
    args = [[str(workdir / "spec.json"), str(rank)] for rank in range(processes)]
    procs = start_group(server, "bench_lib.parity.train", args, workdir / "log.txt")
    stopped = supervise(procs, RUN_TIMEOUT_S, grace_s=PEER_GRACE_S)
    errors = [json.loads(f.read_text())["error"] for f in sorted(workdir.glob("error*.json"))]
    if errors:
        return [], errors[0]
    if not result_path(workdir).exists():
        codes = [p.returncode for p in procs]
        late = f"; still running after {RUN_TIMEOUT_S:g} s, killed" if stopped else ""
        return [], f"no result (exit codes {codes}{late})"
    data = json.loads(result_path(workdir).read_text())
    return [EpochResult(**e) for e in data["epochs"]], ""


def launch_all(jobs: list[Job], rig: Rig,
               on_done: Callable[[int, Job, Outcome, float], None] | None = None,
               ) -> list[Outcome]:
    """Every job's outcome, in the order of ``jobs``; ``on_done(finished, job, outcome,
    seconds)`` as each ends (its progress line; ``finished`` counts the jobs done so far).
    Every rank is forked by one fork server (``processes.forkserver``).

    On a cpu rig the one-process jobs go side by side, each pinned to a free worker (a
    model's ``single`` at its seeds, in float64, ``mp``, ``accum`` ...: half their time on
    2 workers); the jobs of a process group follow, one at a time, on every worker. A cuda
    rig runs one at a time (a one-process run there holds the first GPUs).
    """
    side = [i for i, j in enumerate(jobs) if j.processes == 1 and rig.kind == "cpu"]
    lock, finished = threading.Lock(), [0]

    def timed(job: Job, spec: ParitySpec) -> Outcome:
        t0 = time.monotonic()
        outcome = launch(spec, job.workdir, job.processes, server)
        if on_done is not None:
            with lock:
                finished[0] += 1
                on_done(finished[0], job, outcome, time.monotonic() - t0)
        return outcome

    free: queue.Queue[int] = queue.Queue()
    for worker in range(rig.num_devices):
        free.put(worker)

    def beside(job: Job) -> Outcome:
        worker = free.get()
        try:
            return timed(job, dataclasses.replace(job.spec, worker=worker))
        finally:
            free.put(worker)

    with ForkServer.take(WARM_MODULES) as server:
        with ThreadPoolExecutor(max_workers=rig.num_devices) as pool:
            outcomes = dict(zip(side, pool.map(beside, [jobs[i] for i in side])))
        for i, job in enumerate(jobs):
            if i not in outcomes:
                outcomes[i] = timed(job, job.spec)
    return [outcomes[i] for i in range(len(jobs))]
