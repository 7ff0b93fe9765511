"""Isolated execution of cases: fresh worker process(es) per launch, with a timeout.

Every process of a launch shares one process group of its own, so a crash, hang or OOM
ends that launch alone: on timeout or on a dead rank the whole group is killed, and the
case still yields exactly one row. Under ``--launcher torchrun`` (``run.launch``) a
multi-process launch is one torchrun agent instead, supervised the same way (timeout,
memory cap, sampler, the ranks' files combined by the same rules); on node 0 of a
multi-node run it is announced to the other nodes, whose runners follow (``follow_sweep``),
and their ranks' files come back over node 0's coordination store (``run.multinode``).

Replication (``Measurement.launches`` = L): the cases of one workload (its ``single`` and
every strategy compared with it) are launched in L rounds, each case once per round in a
seeded shuffled order (the same in every run, so a baseline and its candidate match), each
launch a fresh process. The launches' spread is what the case's interval and its speedup's
interval are made of (``analysis.stats.launch_interval``; the speedup pairs each round's
launches), so slow drift, a noisy launch and the position in the sweep count as noise, not
as a difference between strategies. The group's rows are written once its last round ends;
after each earlier round its rows so far, made by the same code (``workload_rows``) from the
launches so far, stand in for them, marked provisional (``RunWriter.write_provisional``), so
that a run stopped mid-workload still has an answer.
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import shutil
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_lib.analysis.collective_fits import Collectives
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
)
from bench_lib.nvml import cuda_visible_gpus
from bench_lib.processes.forkserver import ForkServer
from bench_lib.processes.supervision import PEER_GRACE_S, supervise
from bench_lib.results.read import provisional_text
from bench_lib.results.store import RunWriter
from bench_lib.rig import Rig
from bench_lib.run.admission import Admission
from bench_lib.run.calibration import Predictor
from bench_lib.run.launch import (
    LOCAL,
    AgentExits,
    AgentRanks,
    Launcher,
    agent_env,
    start_agent,
    torchrun_args,
)
from bench_lib.run.launch_parts import with_unaccounted
from bench_lib.run.multinode import (
    Coordinator,
    Follower,
    LaunchNotice,
    LaunchWatch,
    NodeReport,
    NodeZeroGone,
    this_node,
)
from bench_lib.run.protocol import (
    CaseOutcome,
    CaseSpec,
    RankResult,
    SampleRow,
    reused_warmup,
)
from bench_lib.run.ranks import combine, launch_ranks, log_tail, rss_over_cap
from bench_lib.run.rows import Row, SpeedupTable, step_rows
from bench_lib.run.workload_rows import RoundCallback, RoundDone, RowInputs, workload_rows
from bench_lib.sweep.cases import Case
from bench_lib.sweep.splits import settle

REPORT_GRACE_S = 15.0
"""Multi-node: how long node 0 waits for the other nodes' reports beyond ``PEER_GRACE_S``
(after which they stop their ranks) once its own have ended."""


def case_sampler(case: Case, rig: Rig, pids: Sequence[int],
                 ranks: Mapping[int, int] | None = None) -> Sampler:
    """A sampler over the devices a case uses; device labels match peak_mem_mib's keys.

    ``ranks`` (under torchrun): the global rank of each of ``pids`` -> its device slot on
    this node, for ranks that need not be 0..n-1 here (by default, ``pids`` are ranks
    0..n-1 on slots 0..n-1). Where NVML cannot be opened (no library, no driver, a GPU not
    found) the GPU columns stay empty and the sampler's ``note`` says why (for the row's
    ``sampler_note``).
    """
    sources: list[Source] = []
    interval_s = case.measurement.sample_interval_ms / 1000
    slots = dict(ranks) if ranks is not None else {r: r for r in range(case.world_size)}
    if rig.kind == "cuda":
        try:
            gpu = {r: rig.cuda_index(s) for r, s in slots.items()}  # slots share a GPU with
            bus = _cuda_bus_ids(max(gpu.values()) + 1)  # --gpu-slots: each samples it whole
            # GPM metrics over at least half an interval: none from the first tick, which
            # comes right after opening.
            sources.append(NvmlSource({str(r): bus[str(g)] for r, g in gpu.items()},
                                      gpm_min_span_s=interval_s / 2))
        except Exception as e:  # whatever it was, it is recorded, not swallowed
            sources.append(UnavailableSource("NVML", e))
    else:
        if case.process_group:
            labels = [str(r) for r in (list(slots) if ranks is not None else range(len(pids)))]
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
            sources.append(NvmlSource(_cuda_bus_ids(rig.num_gpus)))
            described += [f"nvml gpu {i}" for i in range(rig.num_gpus)]
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
    GPUs differently (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER); a MIG instance's UUID
    where CUDA_VISIBLE_DEVICES names one (the process has that instance, not the card:
    ``NvmlSource`` reads it as such).

    Read through NVML alone, so the runner never creates a CUDA context (one would hold
    memory on a GPU the case measures): ``nvml.cuda_visible_gpus`` maps CUDA's visible
    indices to bus ids as CUDA_VISIBLE_DEVICES says, taking CUDA's order as PCI bus order,
    which holds under CUDA_DEVICE_ORDER=PCI_BUS_ID (the command sets it unless the user set
    an order) and on machines of identical GPUs. Raises where NVML cannot be read, sees
    fewer than ``count`` visible GPUs, or cannot tell CUDA's numbering of mixed GPUs
    (``nvml.CudaOrderUnknown``).
    """
    gpus = cuda_visible_gpus(nvml)
    if len(gpus) < count:
        raise RuntimeError(f"NVML sees {len(gpus)} GPU(s) visible to CUDA "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}), "
                           f"the case needs {count}")
    return {str(g.cuda_index): g.mig_uuid or g.bus_id for g in gpus[:count]}


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


def run_case(case: Case, rig: Rig, work_root: Path, trace: bool = True,
             cut: str = "", launcher: Launcher = LOCAL,
             coordinator: Coordinator | None = None, launch: int = 0,
             server: ForkServer | None = None,
             warmup_steps: int | None = None, compute_only: bool = True) -> CaseOutcome:
    """Run one launch of a case in fresh process(es) and return its outcome (never raises
    for the case); ``trace``: trace a step for the pipeline timeline after the timed ones;
    ``compute_only``: time the steps with no collective after them (``CaseSpec``);
    ``cut``: the stage cut to use (``CaseSpec.cut``). ``launcher``: how its ranks start
    (a case of one process always starts here); ``coordinator`` and ``launch`` (its round):
    node 0's side of a multi-node run. ``server``: the run's fork server, which starts the
    local launcher's ranks (None: each rank a fresh interpreter). ``warmup_steps``: a fixed
    warm-up (``CaseSpec.warmup_steps``).

    The launch's wall time runs from its case folder's creation to its removal; its
    ``parts_s`` say where it went beyond the steps (``launch_parts``): the ranks' parts, this
    side's ``prepare_s`` (the folder and spec), ``sampler_s`` and ``collect_s`` (the rank
    files combined, the folder removed), and the unaccounted rest."""
    start = time.monotonic()
    case_dir = work_root / case.case_id
    shutil.rmtree(case_dir, ignore_errors=True)
    case_dir.mkdir(parents=True)
    spec_path = case_dir / "spec.json"
    CaseSpec(case, rig, trace, cut, warmup_steps, compute_only).write(spec_path)
    log_path = case_dir / "worker.log"
    # The machine's and our CPU times: contention over the case. Ranks the fork server
    # reaped are its children, not ours: it reports their CPU.
    def snapshot() -> CpuSnapshot:
        return CpuSnapshot.now(server.reaped_cpu_s if server is not None else 0.0)

    cpu_start = snapshot()
    prepare_s = time.monotonic() - start
    if launcher.kind == "torchrun" and case.process_group:
        outcome = _run_torchrun(case, rig, case_dir, log_path, launcher, coordinator,
                                launch, trace, cut, warmup_steps, compute_only)
    else:
        outcome = _run_local(case, rig, case_dir, log_path, server)
    returned = time.monotonic()
    # Every rank has been reaped (supervise waits for them; under torchrun the agent reaped
    # its ranks and we the agent): their CPU is in our children's, or the server's count.
    outcome.machine_load = machine_load(cpu_start, snapshot())
    if outcome.status == "ok" and not outcome.trace_note:  # else keep worker.log: why
        shutil.rmtree(case_dir, ignore_errors=True)
    end = time.monotonic()
    outcome.wall_time_s = end - start
    parts = outcome.parts_s | {"prepare_s": prepare_s,
                               "collect_s": outcome.parts_s.get("collect_s", 0.0) + end - returned}
    outcome.parts_s = with_unaccounted(parts, outcome.wall_time_s, sum(outcome.step_times_s),
                                       outcome.warmup_time_s)
    return outcome


def _run_local(case: Case, rig: Rig, case_dir: Path, log_path: Path,
               server: ForkServer | None = None) -> CaseOutcome:
    """The local launcher: the runner starts every rank itself (``launch_ranks``)."""
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


@dataclass
class AgentRun:
    """This node's part of one torchrun launch, as its runner saw it."""

    stopped: tuple[str, str] | None
    """Why the runner stopped the agent (``supervise``), if it did."""
    exits: AgentExits
    samples: list[SampleRow]
    sampler_note: str


def run_agent(case: Case, rig: Rig, case_dir: Path, log_path: Path, launcher: Launcher,
              rdzv_id: str = "", watch: LaunchWatch | None = None) -> AgentRun:
    """Start this node's torchrun agent for one launch of ``case`` and supervise it as the
    local launcher's ranks are: the case timeout, the memory cap, the sampler (from when
    the ranks are found: ``launch.AgentRanks``), and ``watch`` (the other nodes)."""
    nproc = case.world_size // launcher.nnodes
    args = torchrun_args(launcher, nproc, rdzv_id, case.measurement.case_timeout_s)
    threads = rig.threads_per_worker if rig.kind == "cpu" else None
    agent = start_agent(case_dir / "spec.json", args, log_path, agent_env(threads))
    ranks = AgentRanks(agent, nproc)
    cap = case.measurement.max_memory_per_device_mib if rig.kind == "cpu" else 0.0
    baselines: dict[int, float] = {}
    samplers: list[Sampler] = []
    with contextlib.ExitStack() as stack:

        def tick() -> tuple[str, str] | None:
            ranks.poll()
            if not samplers and ranks.complete:
                order = sorted(ranks.pids)
                pids, slots = [ranks.pids[r] for r in order], {r: ranks.local[r] for r in order}
                samplers.append(stack.enter_context(case_sampler(case, rig, pids, slots)))
            if cap and (why := rss_over_cap(ranks.procs, cap, case_dir, 1, baselines)):
                return "oom", why
            return watch() if watch is not None else None

        stopped = supervise([agent], case.measurement.case_timeout_s, watch=tick,
                             kill=ranks.kill)
    ended = time.time()
    try:
        log_text = log_path.read_text(errors="replace")
    except OSError:
        log_text = ""
    sampler = samplers[0] if samplers else None
    return AgentRun(stopped, AgentExits.of(ranks, log_text, ended),
                    sampler.samples if sampler else [],
                    sampler.note if sampler else "no samples: the ranks ended before all "
                                                 "were found")


def _run_torchrun(case: Case, rig: Rig, case_dir: Path, log_path: Path, launcher: Launcher,
                  coordinator: Coordinator | None, launch: int, trace: bool,
                  cut: str, warmup_steps: int | None = None,
                  compute_only: bool = True) -> CaseOutcome:
    """One launch through torchrun: this node's agent; on node 0 of a multi-node run,
    announced to the other nodes first, and their reports gathered after
    (``run.multinode``)."""
    if not launcher.multi_node:
        part = run_agent(case, rig, case_dir, log_path, launcher)
        outcome = _combine_launch(case_dir, case.world_size, log_path, part.stopped,
                                  [part.exits])
    else:
        if coordinator is None:
            raise ValueError("node 0 of a multi-node run needs its coordinator")
        notice = coordinator.announce(case.case_id, launch, trace, cut, warmup_steps,
                                      compute_only)
        part = run_agent(case, rig, case_dir, log_path, launcher, notice.rdzv_id,
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


def run_follower(cases: Sequence[Case], rig: Rig, launcher: Launcher, out: Path) -> str:
    """A non-first node's whole run: join node 0 (``CoordinationError`` when it cannot),
    then ``follow_sweep``, with its case folders under ``out/<run id>.node<I>`` (kept only
    for launches that failed here: their worker.log says why)."""
    follower = Follower(launcher, this_node(rig, launcher, cases))
    try:
        run_id = follower.wait_welcome()
    except BaseException:
        follower.close()
        raise
    return follow_sweep(cases, rig, launcher, follower,
                        out / f"{run_id}.node{launcher.node_rank}")


def follow_sweep(cases: Sequence[Case], rig: Rig, launcher: Launcher, follower: Follower,
                 work_root: Path) -> str:
    """A non-first node's run: start this node's agent for each launch node 0 announces,
    and report its part, until node 0 ends the run; returns how it ended (``done``,
    ``interrupted``...). Raises ``multinode.NodeZeroGone`` when node 0 vanishes."""
    by_id = {c.case_id: c for c in cases}
    seq = 0
    try:
        while not (notice := follower.next_notice(seq)).end:
            case = by_id.get(notice.case_id)
            if case is None:  # the digest check makes this a bug, not a user's mistake
                report = NodeReport(launcher.node_rank, socket.gethostname(), stopped=(
                    "error", f"node {launcher.node_rank} has no case {notice.case_id}"))
            else:
                report = _follow_launch(case, rig, launcher, follower, notice, work_root)
            follower.report(seq, report)
            seq += 1
        return notice.end
    except KeyboardInterrupt:
        with contextlib.suppress(NodeZeroGone):  # node 0 may be gone: nobody to tell
            follower.report(seq, NodeReport(launcher.node_rank, socket.gethostname(), stopped=(
                "error", f"node {launcher.node_rank} was interrupted")))
        raise
    finally:
        follower.close()
        if work_root.exists() and not any(work_root.iterdir()):
            work_root.rmdir()


def _follow_launch(case: Case, rig: Rig, launcher: Launcher, follower: Follower,
                   notice: LaunchNotice, work_root: Path) -> NodeReport:
    """This node's part of one announced launch, as a report for node 0."""
    case_dir = work_root / f"{notice.seq}_{case.case_id}"
    shutil.rmtree(case_dir, ignore_errors=True)
    case_dir.mkdir(parents=True)
    CaseSpec(case, rig, notice.trace, notice.cut, notice.warmup_steps,
             notice.compute_only).write(
        case_dir / "spec.json")
    log_path = case_dir / "worker.log"
    part = run_agent(case, rig, case_dir, log_path, launcher, notice.rdzv_id,
                     lambda: follower.should_stop(notice.seq, PEER_GRACE_S))
    files = {int(p.stem.removeprefix("rank")): p for p in case_dir.glob("rank*.json")
             if p.stem.removeprefix("rank").isdigit()}  # not rank<N>.baseline.json
    report = NodeReport(launcher.node_rank, socket.gethostname(),
                        {rank: path.read_text() for rank, path in files.items()},
                        part.exits.exit_codes, part.exits.exited_at, part.stopped,
                        log_tail(log_path))
    fine = (part.stopped is None and len(files) == case.world_size // launcher.nnodes
            and all(RankResult.read(p).status == "ok" for p in files.values()))
    if fine:
        shutil.rmtree(case_dir, ignore_errors=True)  # else keep worker.log: why
    return report


def round_order(count: int, round_index: int) -> list[int]:
    """The order of a workload's ``count`` cases in round ``round_index``: a shuffle seeded
    by the round alone, so every run of the same sweep launches in the same order."""
    order = list(range(count))
    random.Random(round_index).shuffle(order)
    return order


def workload_groups(cases: list[Case]) -> list[list[int]]:
    """Indices of the cases of each workload (``Case.group_key``: its batch-curve points
    with it), in first-seen order."""
    groups: dict[tuple[str, int, int, str, str], list[int]] = {}
    for i, case in enumerate(cases):
        groups.setdefault(case.group_key, []).append(i)
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
    launcher: Launcher = LOCAL,
    coordinator: Coordinator | None = None,
    admission: Admission | None = None,
    collectives: Collectives | None = None,
    server: ForkServer | None = None,
    predictor: Predictor | None = None,
    on_round_done: RoundCallback | None = None,
) -> list[Row]:
    """Run every case, workload by workload in rounds of launches (module docstring),
    writing each workload's rows once its last round ends; returns the rows in the order
    written (``cases``' order within a workload: ``single`` first, as ``baselines_first``
    puts it, so its speedups are known when the others' rows are made). After each earlier
    round, the workload's provisional rows (``workload_rows`` on the launches so far)
    replace the last round's at the end of cases.csv; ``on_round_done`` gets them after
    every round, the last one's final rows too.

    ``attainable_peak`` is the rig's measured FLOP peak, for the MFU columns; ``idle`` its
    idle power, for the net energy column. A case whose launch fails is not launched again.
    ``launcher``: how multi-process cases start their ranks; ``coordinator``: node 0's side
    of a multi-node run, told at the end (or on Ctrl-C) so that the other nodes stop too.
    ``admission``: each case's predicted memory, and the refusal of a case predicted not to
    fit (``run.admission``; default: ``Admission.of`` the cases on ``rig``).
    ``collectives``: the rig's measured collectives, for the ddp/fsdp and p2p bounds.
    ``server``: the run's fork server, which forks the local launcher's ranks
    (``processes.forkserver``) where it can make their memory read as fresh interpreters'
    (``ForkServer.mirrors_memory``); None, or a server that cannot: fresh interpreters.
    ``predictor``: predicts each case's step time before its workload's first round
    (``run.calibration``; None: no prediction columns).
    """
    admission = admission or Admission.of(rig, cases)
    if admission.note:  # e.g. a GPU in MIG mode whose instance's memory NVML cannot name
        print(f"memory admission: {admission.note}: no case is refused before its launch",
              file=sys.stderr, flush=True)
    try:
        rows = _run_groups(cases, rig, writer, on_case_done, on_launch_start,
                           attainable_peak, idle, on_launch_done, launcher, coordinator,
                           admission, collectives, memory_true_forks(server), predictor,
                           on_round_done)
    except BaseException as e:
        if coordinator is not None:
            coordinator.finish("interrupted" if isinstance(e, KeyboardInterrupt)
                               else f"node 0 failed: {type(e).__name__}: {e}")
        raise
    if coordinator is not None:
        coordinator.finish("done")
    return rows


def _run_groups(
    cases: list[Case], rig: Rig, writer: RunWriter,
    on_case_done: Callable[[int, Case, Row], None] | None,
    on_launch_start: LaunchStart | None, attainable_peak: AttainablePeak | None,
    idle: IdlePower | None, on_launch_done: LaunchDone | None, launcher: Launcher,
    coordinator: Coordinator | None, admission: Admission,
    collectives: Collectives | None = None, server: ForkServer | None = None,
    predictor: Predictor | None = None, on_round_done: RoundCallback | None = None,
) -> list[Row]:
    """``run_sweep``'s walk: workload by workload, round by round."""
    work_root = writer.run_dir / ".work"
    rows = []
    inputs = RowInputs(rig, admission, attainable_peak, idle, collectives,
                       predictor.copies if predictor is not None else None)
    speedups = SpeedupTable()
    speedups.seed(writer.run_dir / "cases.csv")  # a resumed run's earlier `single` rows
    optimizer_steps: dict[tuple[str, int, int, str, str], float] = {}
    groups = workload_groups(cases)
    for g, group in enumerate(groups):
        launched: dict[int, list[CaseOutcome]] = {i: [] for i in group}
        # Every case predicted before the workload's first launch (calibrating it first).
        predicted = ({i: predictor.predict(cases[i]) for i in group
                      if cases[i].status is None} if predictor is not None else {})
        cases = settle(cases, group, predicted)  # a split search's unchosen: skipped rows
        rounds = max(cases[i].measurement.launches for i in group)
        for r in range(rounds):
            for k in round_order(len(group), r):
                i = group[k]
                case, done = cases[i], launched[group[k]]
                if (case.status is not None or r >= case.measurement.launches
                        or any(o.status != "ok" for o in done)):
                    continue
                if not done and (why := admission.refusal(case)):
                    done.append(CaseOutcome("oom", why))  # predicted: never launched
                    continue
                if on_launch_start:
                    on_launch_start(i, case, r)
                # Later launches reuse the first launch's cut (the same configuration, and
                # no second profiling of a balanced cut; the first launch takes it from the
                # calibration's block times where it has them) and the warm-up it found,
                # without the steps that showed it was over (``reused_warmup``). Only the
                # first traces; every one times the compute-only steps (a median, not one
                # launch's moment: ``CaseOutcome.compute_step_s``).
                cut = (done[0].partition if done
                       else predictor.cut(case) if predictor is not None else "")
                warmup = (reused_warmup(done[0], case.measurement.warmup_steps)
                          if done else None)
                done.append(run_case(case, rig, work_root, trace=not done, cut=cut,
                                     launcher=launcher, coordinator=coordinator, launch=r,
                                     server=server, warmup_steps=warmup,
                                     compute_only=True))
                if on_launch_done:
                    on_launch_done(i, case, r, done[-1])
            if r + 1 < rounds:  # the answer so far, by the final rows' code (copied tables)
                text = provisional_text(r + 1, rounds)
                so_far = [row | {"provisional": text} for _, row, _ in workload_rows(
                    inputs, cases, group, launched, predicted, copy.deepcopy(speedups),
                    dict(optimizer_steps))]
                writer.write_provisional(so_far)
                if on_round_done:
                    on_round_done(RoundDone(tuple(so_far), r + 1, rounds, g + 1, len(groups)))
        final = workload_rows(inputs, cases, group, launched, predicted, speedups,
                              optimizer_steps)
        for i, row, outcome in final:
            writer.write_case(row, step_rows(outcome), outcome.timeline, samples=outcome.samples)
            rows.append(row)
            if on_case_done:
                on_case_done(i, cases[i], row)
        if on_round_done:
            on_round_done(RoundDone(tuple(row for _, row, _ in final), rounds, rounds, g + 1,
                                    len(groups)))
    if work_root.exists() and not any(work_root.iterdir()):
        work_root.rmdir()
    return rows
