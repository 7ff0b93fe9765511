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
import dataclasses
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from bench_lib.analysis.collective_fits import Collectives
from bench_lib.launch.protocol import CaseOutcome, CaseSpec, reused_warmup
from bench_lib.measure.energy import IdlePower
from bench_lib.measure.flop_peak import AttainablePeak
from bench_lib.prediction.admission import Admission
from bench_lib.prediction.predictor import Predictor
from bench_lib.results.cells import Row
from bench_lib.results.read import provisional_text
from bench_lib.results.store import RunWriter
from bench_lib.rig import Rig
from bench_lib.rows.rows import step_rows
from bench_lib.rows.speedup_table import SpeedupTable
from bench_lib.rows.workload_rows import RoundCallback, RoundDone, RowInputs, workload_rows
from bench_lib.run.case_launch import LaunchOptions, memory_true_forks, run_case
from bench_lib.sweep.cases import Case
from bench_lib.sweep.expansion import workload_groups
from bench_lib.sweep.splits import settle


def round_order(count: int, round_index: int) -> list[int]:
    """The order of a workload's ``count`` cases in round ``round_index``: a shuffle seeded
    by the round alone, so every run of the same sweep launches in the same order."""
    order = list(range(count))
    random.Random(round_index).shuffle(order)
    return order


CaseDone = Callable[[int, Case, Row], None]
"""(case index, case, its final row) once the row is written."""
LaunchStart = Callable[[int, Case, int], None]
"""(case index, case, launch index) as a launch starts."""
LaunchDone = Callable[[int, Case, int, CaseOutcome], None]
"""(case index, case, launch index, the launch's outcome) as it ends."""


@dataclass(frozen=True)
class SweepOptions:
    """What a sweep runs with besides its cases: how its launches start, what its cases are
    predicted and its rows priced with; made once where the plan is (``commands.run``)."""

    launch: LaunchOptions = field(default_factory=LaunchOptions)
    """How every launch starts: the launcher, node 0's coordinator of a multi-node run (told
    at the end, or on Ctrl-C, so that the other nodes stop too), the run's fork server
    (used where its forked ranks' memory reads as fresh interpreters':
    ``case_launch.memory_true_forks``)."""
    attainable_peak: AttainablePeak | None = None
    """The rig's measured FLOP peak, for the MFU columns."""
    idle: IdlePower | None = None
    """The rig's idle power, for the net energy column."""
    collectives: Collectives | None = None
    """The rig's measured collectives, for the ddp/fsdp and p2p bounds."""
    admission: Admission | None = None
    """Each case's predicted memory, and the refusal of a case predicted not to fit
    (``prediction.admission``); None: ``Admission.of`` the cases on the rig."""
    predictor: Predictor | None = None
    """Predicts each case's step time before its workload's first round
    (``prediction.predictor``); None: no prediction columns."""


@dataclass(frozen=True)
class SweepCallbacks:
    """What the sweep tells its caller as it goes (None: nothing)."""

    on_case_done: CaseDone | None = None
    on_launch_start: LaunchStart | None = None
    on_launch_done: LaunchDone | None = None
    on_round_done: RoundCallback | None = None
    """A workload's rows after each of its rounds (``RoundDone``): provisional, then after
    the last one its final rows."""


def run_sweep(cases: list[Case], rig: Rig, writer: RunWriter,
              options: SweepOptions = SweepOptions(),
              callbacks: SweepCallbacks = SweepCallbacks()) -> list[Row]:
    """Run every case, workload by workload in rounds of launches (module docstring),
    writing each workload's rows once its last round ends; returns the rows in the order
    written (``cases``' order within a workload: ``single`` first, as ``baselines_first``
    puts it, so its speedups are known when the others' rows are made). After each earlier
    round, the workload's provisional rows (``workload_rows`` on the launches so far)
    replace the last round's at the end of cases.csv; ``callbacks.on_round_done`` gets them
    after every round, the last one's final rows too. A case whose launch fails is not
    launched again. ``options``: how the launches start, what the rows are priced with
    (``SweepOptions``).
    """
    admission = options.admission or Admission.of(rig, cases)
    if admission.note:  # e.g. a GPU in MIG mode whose instance's memory NVML cannot name
        print(f"memory admission: {admission.note}: no case is refused before its launch",
              file=sys.stderr, flush=True)
    predictor, coordinator = options.predictor, options.launch.coordinator
    inputs = RowInputs(rig, admission, options.attainable_peak, options.idle,
                       options.collectives,
                       predictor.copies if predictor is not None else None)
    try:
        launch = dataclasses.replace(options.launch,
                                     server=memory_true_forks(options.launch.server))
        rows = _run_groups(cases, writer, inputs, launch, predictor, callbacks)
    except BaseException as e:
        if coordinator is not None:
            coordinator.finish("interrupted" if isinstance(e, KeyboardInterrupt)
                               else f"node 0 failed: {type(e).__name__}: {e}")
        raise
    if coordinator is not None:
        coordinator.finish("done")
    return rows


def _run_groups(cases: list[Case], writer: RunWriter, inputs: RowInputs,
                launch: LaunchOptions, predictor: Predictor | None,
                callbacks: SweepCallbacks) -> list[Row]:
    """``run_sweep``'s walk: workload by workload, round by round (``inputs.rig``, and
    ``inputs.admission`` refusing a case before its first launch)."""
    work_root = writer.run_dir / ".work"
    rows = []
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
                if not done and (why := inputs.admission.refusal(case)):
                    done.append(CaseOutcome("oom", why))  # predicted: never launched
                    continue
                if callbacks.on_launch_start:
                    callbacks.on_launch_start(i, case, r)
                # Later launches reuse the first launch's cut (the same configuration, and
                # no second profiling of a balanced cut; the first launch takes it from the
                # calibration's block times where it has them) and the warm-up it found,
                # without the steps that showed it was over (``reused_warmup``). Only the
                # first traces; every one times the compute-only steps (a median, not one
                # launch's moment: ``CaseOutcome.compute_step_s``); none where the
                # measurement runs no diagnostics.
                cut = (done[0].partition if done
                       else predictor.cut(case) if predictor is not None else "")
                warmup = (reused_warmup(done[0], case.measurement.warmup_steps)
                          if done else None)
                diagnose = case.measurement.diagnostics
                spec = CaseSpec(case, inputs.rig, trace=diagnose and not done, cut=cut,
                                warmup_steps=warmup, compute_only=diagnose)
                done.append(run_case(spec, work_root, launch=r, options=launch))
                if callbacks.on_launch_done:
                    callbacks.on_launch_done(i, case, r, done[-1])
            if r + 1 < rounds:  # the answer so far, by the final rows' code (copied tables)
                text = provisional_text(r + 1, rounds)
                so_far = [row | {"provisional": text} for _, row, _ in workload_rows(
                    inputs, cases, group, launched, predicted, copy.deepcopy(speedups),
                    dict(optimizer_steps))]
                writer.write_provisional(so_far)
                if callbacks.on_round_done:
                    callbacks.on_round_done(RoundDone(tuple(so_far), r + 1, rounds, g + 1,
                                                      len(groups)))
        final = workload_rows(inputs, cases, group, launched, predicted, speedups,
                              optimizer_steps)
        for i, row, outcome in final:
            writer.write_case(row, step_rows(outcome), outcome.timeline, samples=outcome.samples)
            rows.append(row)
            if callbacks.on_case_done:
                callbacks.on_case_done(i, cases[i], row)
        if callbacks.on_round_done:
            callbacks.on_round_done(RoundDone(tuple(row for _, row, _ in final), rounds,
                                              rounds, g + 1, len(groups)))
    if work_root.exists() and not any(work_root.iterdir()):
        work_root.rmdir()
    return rows
