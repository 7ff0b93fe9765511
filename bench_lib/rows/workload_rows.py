"""A workload's cases.csv rows from its launches so far: one code for the final rows (after
its last round) and the provisional ones (after each earlier round), so that the answer a
stopped run leaves is made exactly as the finished run's (``run.runner`` calls it; the
runner's rounds and launches are there)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bench_lib.analysis import step_parts
from bench_lib.analysis.collective_fits import Collectives
from bench_lib.launch.protocol import CaseOutcome
from bench_lib.measure.energy import IdlePower
from bench_lib.measure.flop_peak import AttainablePeak
from bench_lib.prediction.admission import Admission
from bench_lib.prediction.predictor import prediction_columns
from bench_lib.results.cells import Row
from bench_lib.rig import Rig
from bench_lib.rows.bound_columns import bound_columns_of, case_bound_or_why
from bench_lib.rows.rows import case_row
from bench_lib.rows.sampler_columns import util_check_columns
from bench_lib.rows.speedup_table import SpeedupTable
from bench_lib.rows.waterfall import waterfall_columns
from bench_lib.strategies.ddp_knobs import DdpKnobs
from bench_lib.sweep.cases import Case

if TYPE_CHECKING:
    from bench_lib.analysis.bound import Bound


def ddp_compute_s(case: Case, workload: Sequence[tuple[Case, CaseOutcome]]) -> float | None:
    """For an fsdp case, the compute of the same local batch measured by a plain ddp case of
    its workload, world size and batch (weak scaling's is another; its no_sync steps:
    ``CaseOutcome.compute_step_s``); None where there is none (fsdp then falls back on
    single's share: ``case_bound``)."""
    if case.strategy != "fsdp":
        return None
    for other, outcome in workload:
        if (other.strategy == "ddp" and outcome.compute_step_s is not None
                and (other.world_size, other.batch_size) == (case.world_size, case.batch_size)
                and other.ddp == DdpKnobs()  # torch's defaults: no hook, no views
                and (other.precision, other.channels_last, other.compile)
                == (case.precision, case.channels_last, case.compile)):
            return outcome.compute_step_s
    return None


def ddp_own_s(case: Case, workload: Sequence[tuple[Case, CaseOutcome]],
              single_steps: Mapping[int, float]) -> float | None:
    """For a ddp case over several devices, DDP's own work measured by a ``ddp-1`` case of
    its workload (``step_parts.ddp_own_s``: its median step less single's at its batch);
    None where the run has none."""
    if case.strategy != "ddp" or case.world_size < 2:
        return None
    for other, outcome in workload:
        if (other.strategy == "ddp-1" and outcome.status == "ok" and outcome.step_times_s
                and other.batch_size in single_steps and other.ddp == case.ddp
                and (other.precision, other.channels_last, other.compile)
                == (case.precision, case.channels_last, case.compile)):
            return step_parts.ddp_own_s(statistics.median(outcome.step_times_s),
                                        single_steps[other.batch_size])
    return None


@dataclass(frozen=True)
class RowInputs:
    """What a run's rows are made of besides their launches (``workload_rows``)."""

    rig: Rig
    admission: Admission
    attainable_peak: AttainablePeak | None = None
    idle: IdlePower | None = None
    collectives: Collectives | None = None
    copies: Callable[[Case], Mapping[int, float] | None] | None = None
    """A case's workload's calibrated copy rate (``Calibration.copies``): fsdp's copies."""


@dataclass(frozen=True)
class RoundDone:
    """A workload's rows after one of its rounds (``run_sweep``'s
    ``SweepCallbacks.on_round_done``)."""

    rows: tuple[Row, ...]
    """Its cases' rows from the launches so far: provisional (their ``provisional`` cell)
    before its last round, final after it."""
    round_done: int
    """Rounds finished, from 1."""
    rounds: int
    """The workload's rounds (its cases' most launches)."""
    workload: int
    """Which workload of the sweep, from 1."""
    workloads: int
    """The sweep's workloads."""

    @property
    def final(self) -> bool:
        """True once the workload's last round is done (its rows are final)."""
        return self.round_done == self.rounds

    @property
    def last(self) -> bool:
        """True after the sweep's last round: what follows is the run's end."""
        return self.final and self.workload == self.workloads

    @property
    def label(self) -> str:
        """The line over the round's answer, e.g. ``workload 1 of 2, after round 2 of 3:``."""
        return (f"workload {self.workload} of {self.workloads}, after round {self.round_done} "
                f"of {self.rounds}" + (" (final):" if self.final else ":"))


RoundCallback = Callable[[RoundDone], None]


def workload_rows(
    inputs: RowInputs, cases: Sequence[Case], group: Sequence[int],
    launched: Mapping[int, Sequence[CaseOutcome]],
    predicted: Mapping[int, tuple[Bound | str, Bound | str]],
    speedups: SpeedupTable, optimizer_steps: dict[tuple[str, int, int, str, str], float],
) -> list[tuple[int, Row, CaseOutcome]]:
    """(case index, row, outcome) of each case of one workload (``group``, ``single``
    first) from its launches so far: the final rows from all of them, the provisional rows
    after an earlier round from that round's, by this one code. ``speedups`` and
    ``optimizer_steps`` learn the workload's single as its row is made (the other rows'
    speedups and waterfalls read it): provisional rows get copies, so that only final rows
    teach later workloads. A case not launched yet (none is, after a round) is left out."""
    outcomes = {i: CaseOutcome(cases[i].status or "", cases[i].reason)
                if cases[i].status is not None else CaseOutcome.of_launches(list(launched[i]))
                for i in group if cases[i].status is not None or launched[i]}
    workload = [(cases[i], outcomes[i]) for i in outcomes]
    made = []
    for i, outcome in outcomes.items():
        case = cases[i]
        row = case_row(case, inputs.rig, outcome, inputs.attainable_peak, inputs.idle)
        if case.status is None:
            row |= inputs.admission.columns(case, list(launched[i]))
        speedups.fill(case, row)
        ddp_compute = ddp_compute_s(case, workload)
        median = row.get("step_time_s_median")
        found = case_bound_or_why(case, inputs.rig, outcome, median,
                                  speedups.single_step_s(case), inputs.collectives,
                                  ddp_compute, inputs.copies(case) if inputs.copies else None)
        row |= bound_columns_of(found, median)
        if (case.strategy == "single" and case.curve_of is None
                and outcome.optimizer_step_s is not None):
            optimizer_steps[case.group_key] = outcome.optimizer_step_s
        row |= waterfall_columns(case, inputs.rig, outcome, row, speedups.single_steps(case),
                                 optimizer_steps.get(case.group_key), found, ddp_compute,
                                 ddp_own_s(case, workload, speedups.single_steps(case)))
        row |= util_check_columns(case, inputs.rig, outcome, row,
                                  optimizer_steps.get(case.group_key), ddp_compute)
        if i in predicted:
            row |= prediction_columns(case.batch_size, case.workload_batch, *predicted[i],
                                      row.get("step_time_s_median"))
        made.append((i, row, outcome))
    return made
