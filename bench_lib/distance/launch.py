"""One launch of a distance case: fresh processes, supervised by the runner's own rules.

The processes start as a training case's ranks do (``launch.ranks.launch_ranks``: one process
group of their own, each told its parent's pid; forked by the run's fork server), running
``bench_lib.distance.worker``; then every launcher's supervision
(``processes.supervision.supervise``: the case timeout, the cpu memory cap through
``ranks.rss_over_cap``, a dead rank's peers killed after their grace) and the runner's
combination of the rank files (``ranks.combine``: the first failure blamed, an ``oom``
first; else the slowest rank per step) decide the launch's ``CaseOutcome``. Rank 0's value
and gradient come back beside it (``Computed``).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench_lib.distance.spec import DistanceSpec, result_file
from bench_lib.launch.protocol import CaseOutcome
from bench_lib.launch.ranks import combine, launch_ranks, rss_over_cap
from bench_lib.processes.forkserver import ForkServer
from bench_lib.processes.supervision import supervise

WORKER_MODULE = "bench_lib.distance.worker"


@dataclass(frozen=True)
class Computed:
    """What rank 0 computed in its last step."""

    value: float
    """D."""
    grad: torch.Tensor | None
    """dD/dW on the CPU, in the case's precision (None: no backward ran)."""


def launch(spec: DistanceSpec, work_root: Path,
           server: ForkServer | None = None) -> tuple[CaseOutcome, Computed | None]:
    """Run one launch of ``spec``'s case (its ranks forked by ``server`` where given);
    its outcome (never raises for the case) and, when ok, rank 0's value and gradient. The
    work folder stays where it did not end ok (its worker.log says why)."""
    case = spec.case
    case_dir = work_root / case.case_id
    shutil.rmtree(case_dir, ignore_errors=True)
    case_dir.mkdir(parents=True)
    spec.write(case_dir / "spec.json")
    log_path = case_dir / "worker.log"
    began = time.monotonic()
    procs = launch_ranks(case_dir / "spec.json", case.processes, log_path, server,
                         WORKER_MODULE)
    cap = spec.measurement.max_memory_per_device_mib if spec.rig.kind == "cpu" else 0.0
    baselines: dict[int, float] = {}

    def over_cap() -> str | None:
        return rss_over_cap(procs, cap, case_dir, 1, baselines)

    exited_at: dict[int, float] = {}
    stopped = supervise(procs, spec.measurement.case_timeout_s, over_cap if cap else None,
                         exited_at)
    outcome = combine(case_dir, procs, log_path, stopped, exited_at)
    outcome.wall_time_s = time.monotonic() - began
    computed = None
    if outcome.status == "ok":
        saved = torch.load(result_file(case_dir), weights_only=True)
        computed = Computed(float(saved["value"]), saved["grad"])
        shutil.rmtree(case_dir, ignore_errors=True)
    return outcome, computed
