"""``python -m bench_lib tune``: search one workload's space by racing (``tune.race``)
instead of sweeping it, and recommend a configuration.

Before anything launches: the space is expanded and validated (bad input: exit 2, nothing
written), the plan printed (candidates, rung 0's estimate, the exhaustive sweep's, the
halving schedule and the budget; ``--dry-run`` stops there), and the memory prediction
refuses what will not fit (``prediction.admission``: recorded ``oom``, reason "predicted: ...",
never launched). Then each launch is one fresh ``run.case_launch.run_case``, short
(``tune.space.race_launch``: every rung alike, so that rungs pair), with no traced step;
later launches reuse the first launch's stage cut, as a sweep's do. Each is printed as it
ends and appended to ``tune.csv``. At the end the run folder gets ``cases.csv`` (one row per
case of the space, the race's launches combined as a sweep combines them, speedups paired
by rung), ``steps.csv`` and ``tune.json`` (the verdict), and the recommendation is printed
(``tune.output``).

Exit codes (``bench_lib.exit_codes``): 0 a recommendation; 1 no candidate measured ok; 2 bad
input; 130 interrupted (the launches so far stay in tune.csv).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import math
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from bench_lib.exit_codes import EXIT_INTERRUPTED, EXIT_NOT_OK, EXIT_OK
from bench_lib.launch.protocol import CaseOutcome, CaseSpec
from bench_lib.processes import interrupts
from bench_lib.rig import Rig
from bench_lib.sweep.cases import Case
from bench_lib.sweep.profile import Profile
from bench_lib.tune import output
from bench_lib.tune.plan import TunePlan
from bench_lib.tune.race import LaunchRecord, LaunchResult, RaceResult, RaceSettings, race
from bench_lib.tune.space import Space, build_space, race_launch

if TYPE_CHECKING:
    from bench_lib.analysis.bound import Bound
    from bench_lib.prediction.admission import Admission
    from bench_lib.processes.forkserver import ForkServer
    from bench_lib.run.case_launch import LaunchOptions

BUDGET_FRACTION = 0.3
"""Default budget: a tenth under the third of the exhaustive sweep's time that issue #17
allows, since tune's own start-up and the error of its rung predictions come on top of the
launch seconds it counts."""
MAX_RUNGS = 4
PREDICTION_MARGIN = 0.25
"""The step-time predictor's worst |error| a skip trusts it within (issue #26's goal for
the worst case on default-cpu; ``docs/tune.md`` gives the measured errors): a candidate is
skipped only where, with every prediction off by this much in the direction that favours
it, it would still be slower per image than the predicted best."""
LaunchFn = Callable[[Case, int, str], CaseOutcome]
"""(case as measured in this rung, rung, stage cut to reuse or '') -> one launch."""
Say = Callable[[str], None]


def one_launch(case: Case) -> Case:
    """``case`` with one launch (an estimate of one full launch)."""
    return dataclasses.replace(case, measurement=dataclasses.replace(case.measurement,
                                                                     launches=1))


def settings_of(plan: TunePlan, space: Space, rig: Rig) -> RaceSettings:
    """The race's settings: the plan's limits, and how much longer the exhaustive sweep's
    launches take than the race's (estimated)."""
    from bench_lib.prediction.duration import case_seconds

    full = sum(case_seconds(one_launch(c), rig) for c in space.candidates)
    short = sum(case_seconds(race_launch(c, space.profile.measurement), rig)
                for c in space.candidates)
    return RaceSettings(max_rungs=plan.max_rungs,
                        budget_s=math.inf if plan.time_budget_s is None else plan.time_budget_s,
                        budget_fraction=plan.budget_fraction,
                        sweep_launches=space.profile.measurement.launches,
                        sweep_over_race=full / short if short else 1.0)


class TuneLog:
    """``tune.csv``: one row per launch, appended and flushed as each ends."""

    def __init__(self, path: Path, run_id: str) -> None:
        from bench_lib.results.schema import TUNE, names

        self.run_id = run_id
        self._file: TextIO = path.open("w", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=names(TUNE))
        self._writer.writeheader()
        self.launches = 0

    def write(self, case: Case, rung: int, outcome: CaseOutcome, median: float | None,
              wall_s: float) -> None:
        self._writer.writerow({
            "run_id": self.run_id, "case_id": case.case_id, "rung": rung,
            "launch": self.launches, "status": outcome.status, "reason": outcome.reason,
            "launch_median_s": "" if median is None else f"{median:.6g}",
            "timed_steps": len(outcome.step_times_s), "warmup_steps": outcome.warmup_steps,
            "wall_time_s": round(wall_s, 3)})
        self._file.flush()
        self.launches += 1

    def close(self) -> None:
        self._file.close()


Predict = Callable[[list[Case]], "dict[str, Bound | str]"]
"""The candidates -> each one's predicted step (``prediction.predictor.Predictor``), by case id."""


def skipped_by_prediction(cases: list[Case], predicted: dict[str, Bound | str],
                          margin: float = PREDICTION_MARGIN) -> dict[str, str]:
    """Case id -> why it is not raced: predicted slower per image than the predicted best
    by more than ``margin`` either way allows (``PREDICTION_MARGIN``). ``single``, the
    reference, and a case without a prediction always race."""
    per_image = {c.case_id: p.step_s / c.batch_size for c in cases
                 if not isinstance(p := predicted.get(c.case_id, ""), str)}
    if not per_image:
        return {}
    best_id = min(per_image, key=lambda k: per_image[k])
    best = per_image[best_id]
    out = {}
    for case in cases:
        mine = per_image.get(case.case_id)
        if case.strategy == "single" or mine is None or mine * (1 - margin) <= best * (1 + margin):
            continue
        out[case.case_id] = (
            f"predicted {1000 * mine:.1f} ms/img, {mine / best:.2f}x the predicted best "
            f"({best_id}: {1000 * best:.1f} ms/img): slower even were both predictions "
            f"{margin:.0%} off")
    return out


def by_prediction(cases: list[Case], predicted: dict[str, Bound | str]) -> list[Case]:
    """``cases`` fastest predicted per image first (``single`` stays first: it is every
    speedup's reference; unpredicted cases last, in their order)."""
    def key(case: Case) -> tuple[int, float]:
        p = predicted.get(case.case_id, "")
        if case.strategy == "single":
            return (0, 0.0)
        return (2, 0.0) if isinstance(p, str) else (1, p.step_s / case.batch_size)

    return sorted(cases, key=key)


def median_of(outcome: CaseOutcome) -> float | None:
    """The median of an ok launch's timed steps (None otherwise)."""
    times = sorted(outcome.step_times_s)
    if outcome.status != "ok" or not times:
        return None
    mid = len(times) // 2
    return times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2


def run_race(space: Space, candidates: list[Case], reference: int | None,
             settings: RaceSettings, launch: LaunchFn, log: TuneLog | None, say: Say,
             seed: int = 0) -> tuple[RaceResult, dict[int, list[CaseOutcome]]]:
    """Race ``candidates`` (those admitted), each launch through ``launch``; returns the
    race and every candidate's launch outcomes in rung order."""
    outcomes: dict[int, list[CaseOutcome]] = {i: [] for i in range(len(candidates))}
    first: list[LaunchRecord] = []
    spent, budget = [0.0], [math.inf]

    def measure(i: int, rung: int) -> LaunchResult:
        case, done = candidates[i], outcomes[i]
        measured = race_launch(case, space.profile.measurement)
        start = time.monotonic()
        outcome = launch(measured, rung, done[0].partition if done else "")
        wall = time.monotonic() - start
        done.append(outcome)
        median = median_of(outcome)
        if log is not None:
            log.write(case, rung, outcome, median, wall)
        spent[0] += wall
        status = "error" if outcome.status == "ok" and median is None else outcome.status
        result = LaunchResult(status, median, len(outcome.step_times_s), wall,
                              outcome.reason or ("no timed step" if median is None else ""))
        detail = (f"median {median:.4g} s/step over {result.steps} steps"
                  if median is not None else f"{status}: {result.reason}")
        left = "" if math.isinf(budget[0]) else f" of ~{budget[0]:.0f}"
        say(f"  rung {rung} {case.case_id}: {detail} ({wall:.1f} s; spent "
            f"{spent[0]:.0f}{left} s)")
        if rung == 0:
            first.append(LaunchRecord(i, 0, len(first), result))
            if len(first) == len(candidates):
                budget[0] = settings.budget_after_first(first)
                say(f"rung 0 done: the exhaustive sweep would spend ~"
                    f"{settings.sweep_seconds(first):.0f} s launching; budget ~"
                    f"{budget[0]:.0f} s")
        return result

    return race(len(candidates), reference, measure, settings, seed), outcomes


def run_tune(plan: TunePlan, rig: Rig, profile: Profile) -> int:
    """The whole ``tune`` command (``commands.tune`` resolves the rig and the profile and
    makes the plan)."""
    import psutil

    started = psutil.Process().create_time()  # the whole command, as its user waits for it
    space = build_space(profile, rig)
    settings = settings_of(plan, space, rig)
    if not plan.quiet or plan.dry_run:
        output.print_plan(space, rig, settings, sys.stderr)
    if plan.dry_run:
        return EXIT_OK
    return execute(plan, space, rig, settings, started)


def execute(plan: TunePlan, space: Space, rig: Rig, settings: RaceSettings,
            started: float, launch: LaunchFn | None = None,
            admission: Admission | None = None, predict: Predict | None = None) -> int:
    """Admit, predict, race, write the run folder, print the recommendation (``started``:
    unix time the command started; ``launch``: one launch of a case, default
    ``run.case_launch.run_case``; ``admission``: the memory prediction, default ``Admission.of``
    the candidates; ``predict``: the step-time prediction, default the profile's
    ``predict_time``: a calibration of the workload, ``prediction.predictor.Predictor``)."""
    with contextlib.ExitStack() as stack:  # the fork server, where one is started
        return _execute(plan, space, rig, settings, started, stack, launch, admission,
                        predict)


def _execute(plan: TunePlan, space: Space, rig: Rig, settings: RaceSettings,
             started: float, stack: contextlib.ExitStack, launch: LaunchFn | None,
             admission: Admission | None, predict: Predict | None = None) -> int:
    """``execute``'s body."""
    from bench_lib.measure import environment
    from bench_lib.prediction.admission import Admission
    from bench_lib.results.store import start_run_dir, write_json_atomic

    def say(text: str) -> None:
        if not plan.quiet:
            print(text, file=sys.stderr, flush=True)

    admission = admission or Admission.of(rig, space.candidates)
    refused = {c.case_id: why for c in space.candidates if (why := admission.refusal(c))}
    for case_id, why in refused.items():
        say(f"  {case_id}: oom ({why}): not launched")
    admitted = [c for c in space.candidates if c.case_id not in refused]
    run_dir = start_run_dir(plan.out, environment.git_info()["sha"], "tune", space.profile.name)
    work_root = run_dir / ".work"
    server = None
    if launch is None:  # every launch forked by one server that imported torch once
        from bench_lib.launch.agent import WARM_MODULES
        from bench_lib.processes.forkserver import ForkServer
        from bench_lib.run.case_launch import LaunchOptions, memory_true_forks

        server = stack.enter_context(ForkServer.take(WARM_MODULES))
        launch = _runner_launch(rig, work_root,
                                LaunchOptions(server=memory_true_forks(server)))
    if predict is None and server is not None and space.profile.predict_time:
        predict = _calibrated(rig, run_dir, server, say, plan.quiet)
    predicted = predict(admitted) if predict is not None else {}
    slow = skipped_by_prediction(admitted, predicted)
    for case_id, why in slow.items():
        say(f"  {case_id}: skipped ({why})")
    admitted = by_prediction([c for c in admitted if c.case_id not in slow], predicted)
    reference = next((i for i, c in enumerate(admitted) if c.strategy == "single"), None)
    env = environment.collect(rig, space.profile.as_dict(), sys.argv,
                              math_mode=space.profile.measurement.math_mode)
    env["tune"] = output.settings_dict(settings, plan.seed, space, refused) | {
        "predicted_slow": slow,
        "predicted_step_s": {k: p.step_s for k, p in predicted.items()
                             if not isinstance(p, str)}}
    write_json_atomic(run_dir / "env.json", env)
    interrupts.catch(signal.SIGTERM, signal.SIGINT)  # held while torch runs here
    log = TuneLog(run_dir / "tune.csv", run_dir.name)
    say(f"tune {run_dir.name}: {len(admitted)} candidates of {space.describe()} on rig "
        f"{rig.label}")
    try:
        result, outcomes = run_race(space, admitted, reference, settings, launch, log, say,
                                    plan.seed)
    except KeyboardInterrupt:
        print(f"interrupted: the launches so far are in {run_dir / 'tune.csv'}",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        log.close()
    if work_root.exists() and not any(work_root.iterdir()):
        work_root.rmdir()
    output.write_cases(run_dir, space, rig, admitted, outcomes, refused, slow, predicted)
    wall = time.time() - started
    answer = output.tune_json(result, admitted, space, rig, settings, plan, wall)
    write_json_atomic(run_dir / "tune.json", answer)
    if not plan.quiet:
        for line in output.result_lines(answer):
            print(line, file=sys.stderr)
    print(run_dir)
    return EXIT_OK if result.winner is not None else EXIT_NOT_OK


def _calibrated(rig: Rig, run_dir: Path, server: ForkServer, say: Say, quiet: bool
                ) -> Predict:
    """The step-time prediction of a real race: the collectives measured and the workload
    calibrated (``prediction.calibration``), as a run does before its cases."""
    from bench_lib.prediction.calibration import describe_calibration
    from bench_lib.prediction.collectives import sweep_collectives
    from bench_lib.prediction.predictor import Predictor

    def predict(cases: list[Case]) -> dict[str, Bound | str]:
        collectives = sweep_collectives(rig, quiet, cases, server)
        predictor = Predictor(cases, rig, run_dir, collectives, server,
                              lambda key, cal: say(describe_calibration(key, cal)))
        return {c.case_id: predictor.predict(c)[0] for c in cases}

    return predict


def _runner_launch(rig: Rig, work_root: Path, options: LaunchOptions) -> LaunchFn:
    """One fresh launch through the runner (``run.case_launch.run_case``), started as
    ``options`` say (the local launcher, its ranks forked by their fork server): no trace,
    no compute-only steps."""
    from bench_lib.run.case_launch import run_case

    def launch(case: Case, rung: int, cut: str) -> CaseOutcome:
        spec = CaseSpec(case, rig, trace=False, cut=cut, compute_only=False)
        return run_case(spec, work_root, launch=rung, options=options)

    return launch
