"""One launch of a case (``run_case``): fresh worker process(es) with a timeout, whichever
launcher starts them; its case folder and spec, the machine's load over it, its wall time
and the parts it went to.

Every process of a launch shares one process group of its own, so a crash, hang or OOM
ends that launch alone: on timeout or on a dead rank the whole group is killed, and the
case still yields exactly one row. The local launcher (``_run_local``) starts the ranks
here (``launch.ranks``). Under ``--launcher torchrun`` (``launch.torchrun``) a multi-process launch
is one torchrun agent instead (``run.agent_launch``), supervised the same way (timeout, memory
cap, sampler, the ranks' files combined by the same rules: ``_run_torchrun``); on node 0
of a multi-node run it is announced to the other nodes, whose runners follow
(``follower_run.follow_sweep``), and their ranks' files come back over node 0's
coordination store (``nodes.coordination``).
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench_lib.launch.launch_parts import with_unaccounted
from bench_lib.launch.protocol import CaseOutcome, CaseSpec
from bench_lib.launch.ranks import combine, launch_ranks, rss_over_cap
from bench_lib.launch.sampling import case_sampler
from bench_lib.launch.torchrun import LOCAL, AgentExits, Launcher
from bench_lib.measure.contention import CpuSnapshot, machine_load
from bench_lib.nodes.coordination import Coordinator
from bench_lib.processes.forkserver import ForkServer
from bench_lib.processes.supervision import PEER_GRACE_S, supervise
from bench_lib.run.agent_launch import run_agent

REPORT_GRACE_S = 15.0
"""Multi-node: how long node 0 waits for the other nodes' reports beyond ``PEER_GRACE_S``
(after which they stop their ranks) once its own have ended."""


def memory_true_forks(server: ForkServer | None) -> ForkServer | None:
    """``server`` if its forked ranks' resident memory reads as fresh interpreters' (so the
    memory columns and the cpu memory cap mean the same either way), else None: fresh
    interpreters, said once on stderr."""
    if server is None or server.mirrors_memory():
        return server
    print("the fork server cannot map its resident library pages into its ranks here "
          "(/proc/self/pagemap unreadable): cases' ranks start as fresh interpreters",
          file=sys.stderr, flush=True)
    return None


@dataclass(frozen=True)
class LaunchOptions:
    """How a run's launches start: decided once where the plan is (``commands.run``,
    ``tune.search``), the same for every launch of the run."""

    launcher: Launcher = LOCAL
    """How a multi-process case starts its ranks (a case of one process always starts
    here)."""
    coordinator: Coordinator | None = None
    """Node 0's side of a multi-node run (``nodes.coordination``), through which its torchrun
    launches are announced to the other nodes; None on one node."""
    server: ForkServer | None = None
    """The run's fork server, which starts the local launcher's ranks (None: each rank a
    fresh interpreter)."""


def run_case(spec: CaseSpec, work_root: Path, launch: int = 0,
             options: LaunchOptions = LaunchOptions()) -> CaseOutcome:
    """Run one launch of a case (``spec``: the case, the rig, and what its ranks are told)
    in fresh process(es) under ``work_root`` and return its outcome (never raises for the
    case); ``launch``: its round, which node 0 of a multi-node run announces with it;
    ``options``: how its ranks start.

    The launch's wall time runs from its case folder's creation to its removal; its
    ``parts_s`` say where it went beyond the steps (``launch_parts``): the ranks' parts, this
    side's ``prepare_s`` (the folder and spec), ``sampler_s`` and ``collect_s`` (the rank
    files combined, the folder removed), and the unaccounted rest."""
    start = time.monotonic()
    case = spec.case
    case_dir = work_root / case.case_id
    shutil.rmtree(case_dir, ignore_errors=True)
    case_dir.mkdir(parents=True)
    spec.write(case_dir / "spec.json")
    log_path = case_dir / "worker.log"
    server = options.server
    # The machine's and our CPU times: contention over the case. Ranks the fork server
    # reaped are its children, not ours: it reports their CPU.
    def snapshot() -> CpuSnapshot:
        return CpuSnapshot.now(server.reaped_cpu_s if server is not None else 0.0)

    cpu_start = snapshot()
    prepare_s = time.monotonic() - start
    if options.launcher.kind == "torchrun" and case.process_group:
        outcome = _run_torchrun(spec, case_dir, log_path, launch, options)
    else:
        outcome = _run_local(spec, case_dir, log_path, server)
    returned = time.monotonic()
    # Every rank has been reaped (supervise waits for them; under torchrun the agent reaped
    # its ranks and we the agent): their CPU is in our children's, or the server's count.
    outcome.machine_load = machine_load(cpu_start, snapshot())
    # A failed case, or one that lacks a timeline or a diagnostic, keeps worker.log: why.
    if outcome.status == "ok" and not (outcome.trace_note or outcome.diagnostics_note):
        shutil.rmtree(case_dir, ignore_errors=True)
    end = time.monotonic()
    outcome.wall_time_s = end - start
    parts = outcome.parts_s | {"prepare_s": prepare_s,
                               "collect_s": outcome.parts_s.get("collect_s", 0.0) + end - returned}
    outcome.parts_s = with_unaccounted(parts, outcome.wall_time_s, sum(outcome.step_times_s),
                                       outcome.warmup_time_s)
    return outcome


def _run_local(spec: CaseSpec, case_dir: Path, log_path: Path,
               server: ForkServer | None) -> CaseOutcome:
    """The local launcher: the runner starts every rank itself (``launch_ranks``)."""
    case, rig = spec.case, spec.rig
    requested = time.monotonic()  # the process start's beginning (launch_parts)
    procs = launch_ranks(case_dir / "spec.json", case.processes, log_path, server)
    # CPU workers are capped here by the resident memory the case adds, per device they
    # drive; GPUs by their allocator (worker.py).
    cap = case.measurement.max_memory_per_device_mib if rig.kind == "cpu" else 0.0
    per_process = 1 if case.process_group else case.world_size
    baselines: dict[int, float] = {}

    def over_cap() -> str | None:
        return rss_over_cap(procs, cap, case_dir, per_process, baselines)

    exited_at: dict[int, float] = {}
    # The sampler starts while the ranks start (off the launch's critical path); its stop,
    # after the last rank is reaped, is on it: sampler_s.
    with case_sampler(case, rig, [p.pid for p in procs]) as sampler:
        stopped = supervise(procs, case.measurement.case_timeout_s,
                             over_cap if cap else None, exited_at)
        reaped = time.monotonic()
    stopped_sampler = time.monotonic()
    # The ranks' files, also when the runner stopped them: one may have failed first.
    outcome = combine(case_dir, procs, log_path, stopped, exited_at, requested, reaped)
    outcome.samples = sampler.samples
    outcome.sampler_note = sampler.note
    outcome.parts_s |= {"sampler_s": stopped_sampler - reaped,
                        "collect_s": time.monotonic() - stopped_sampler}
    return outcome


def _run_torchrun(spec: CaseSpec, case_dir: Path, log_path: Path, launch: int,
                  options: LaunchOptions) -> CaseOutcome:
    """One launch through torchrun (``options.launcher``): this node's agent; on node 0 of a
    multi-node run, announced to the other nodes first (``options.coordinator``), and their
    reports gathered after (``nodes.coordination``)."""
    case, launcher, coordinator = spec.case, options.launcher, options.coordinator
    if not launcher.multi_node:
        part = run_agent(spec, case_dir, log_path, launcher)
        outcome = _combine_launch(case_dir, case.world_size, log_path, part.stopped,
                                  [part.exits])
    else:
        if coordinator is None:
            raise ValueError("node 0 of a multi-node run needs its coordinator")
        notice = coordinator.announce(spec, launch)
        part = run_agent(spec, case_dir, log_path, launcher, notice.rdzv_id,
                         coordinator.watch(notice.seq, PEER_GRACE_S))
        coordinator.over(notice.seq)
        reports, lost = coordinator.collect(notice.seq, PEER_GRACE_S + REPORT_GRACE_S)
        exits = [part.exits]
        with log_path.open("a") as log:
            for report in reports.values():
                for rank, text in report.results.items():
                    path = case_dir / f"rank{rank}.json"
                    if not path.exists():
                        path.write_text(text)
                log.write(f"\n--- node {report.node} ({report.hostname}) ---\n"
                          f"{report.log_tail}\n")
                exits.append(AgentExits(report.exit_codes, report.exited_at))
        outcome = _combine_launch(case_dir, case.world_size, log_path, part.stopped, exits,
                                  lost)
    outcome.samples = part.samples
    outcome.sampler_note = part.sampler_note
    return outcome


@dataclass(frozen=True)
class _Exit:
    returncode: int | None


def _combine_launch(case_dir: Path, world_size: int, log_path: Path,
                    stopped: tuple[str, str] | None, exits: Sequence[AgentExits],
                    lost: Mapping[int, str] | None = None) -> CaseOutcome:
    """``combine`` for a torchrun launch: the nodes' exit codes and exit times, and the
    nodes lost meanwhile named first (unless a rank ran out of memory: that is blamed
    first, as always)."""
    codes = {r: c for e in exits for r, c in e.exit_codes.items()}
    exited_at = {r: t for e in exits for r, t in e.exited_at.items()}
    outcome = combine(case_dir, [_Exit(codes.get(r)) for r in range(world_size)], log_path,
                       stopped, exited_at)
    if not lost or outcome.status == "oom":
        return outcome
    why = "; ".join(lost[i] for i in sorted(lost))
    tail = "" if outcome.status == "ok" or outcome.reason.startswith(why) else outcome.reason
    return CaseOutcome("error", f"{why}; then {tail}" if tail else why)
