"""The sweep's walk (``run_sweep``): the cases a workload at a time, in rounds of launches
(each one ``case_launch.run_case``), the workload's rows written once its last round ends;
node 0's coordinator told when the run ends.

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

import copy
import random
import sys
from collections.abc import Callable

from bench_lib.analysis.collective_fits import Collectives
from bench_lib.launch.protocol import CaseOutcome, CaseSpec, reused_warmup
from bench_lib.launch.torchrun import LOCAL, Launcher
from bench_lib.measure.energy import IdlePower
from bench_lib.measure.flop_peak import AttainablePeak
from bench_lib.nodes.coordination import Coordinator
from bench_lib.prediction.admission import Admission
from bench_lib.prediction.predictor import Predictor
from bench_lib.processes.forkserver import ForkServer
from bench_lib.results.cells import Row
from bench_lib.results.read import provisional_text
from bench_lib.results.store import RunWriter
from bench_lib.rig import Rig
from bench_lib.rows.rows import step_rows
from bench_lib.rows.speedup_table import SpeedupTable
from bench_lib.rows.workload_rows import RoundCallback, RoundDone, RowInputs, workload_rows
from bench_lib.run.case_launch import LaunchOptions, memory_true_forks, run_case
from bench_lib.sweep.cases import Case
from bench_lib.sweep.splits import settle


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
    fit (``prediction.admission``; default: ``Admission.of`` the cases on ``rig``).
    ``collectives``: the rig's measured collectives, for the ddp/fsdp and p2p bounds.
    ``server``: the run's fork server, which forks the local launcher's ranks
    (``processes.forkserver``) where it can make their memory read as fresh interpreters'
    (``ForkServer.mirrors_memory``); None, or a server that cannot: fresh interpreters.
    ``predictor``: predicts each case's step time before its workload's first round
    (``prediction.predictor``; None: no prediction columns).
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
    options = LaunchOptions(launcher, coordinator, server)
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
                spec = CaseSpec(case, rig, trace=not done, cut=cut, warmup_steps=warmup,
                                compute_only=True)
                done.append(run_case(spec, work_root, launch=r, options=options))
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
