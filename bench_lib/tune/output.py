"""What ``tune`` prints and writes: the plan before it launches, the run folder's
``cases.csv`` and ``tune.json``, and the recommendation.

tune.json (one object): ``verdict`` (``race.VERDICTS``), ``stop_reason``, ``winner``,
``runner_up`` and ``tie`` (case ids), ``speedup_vs_single`` and ``speedup_vs_runner_up``
(point, low, high, confidence, rounds, note; null where there is none), ``command`` (the
``run`` command that measures the winner beside ``single``), ``ranking`` (case id, step
time as the geometric mean of its launch medians, launches), ``rungs`` (the case ids
launched in each rung, in launch order), ``launches``, ``launch_seconds``, ``budget_s`` and
``wall_time_s`` (the whole command).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from bench_lib.analysis.stats import CI_CONFIDENCE, LaunchInterval
from bench_lib.launch.protocol import CaseOutcome
from bench_lib.prediction.duration import case_seconds, format_duration
from bench_lib.rig import Rig
from bench_lib.sweep.cases import Case
from bench_lib.tune.plan import TunePlan
from bench_lib.tune.race import RaceResult, RaceSettings
from bench_lib.tune.space import (
    RACE_MAX_TIME_S,
    RACE_TIMED_STEPS,
    RACE_WARMUP_STEPS,
    Space,
    race_launch,
    reproduce_command,
)

if TYPE_CHECKING:
    from bench_lib.analysis.bound import Bound


def halving_sizes(count: int, settings: RaceSettings) -> list[int]:
    """Candidates per rung if nothing separates, fails or runs out of budget."""
    sizes = [count]
    while len(sizes) < settings.max_rungs:
        sizes.append(settings.keep(sizes[-1]))
    return sizes


def print_plan(space: Space, rig: Rig, settings: RaceSettings, stream: TextIO) -> None:
    """The space, each case's estimated launch in the race and in the sweep, and the plan."""
    width = max(len(c.case_id) for c in space.cases)
    print(f"{'case':<{width}}  {'will':<11}  {'race':>6}  {'sweep':>6}  reason (estimated "
          "seconds per launch)", file=stream)
    for case in space.cases:
        first = case_seconds(race_launch(case, space.profile.measurement), rig)
        full = case_seconds(case, rig) / case.measurement.launches
        print(f"{case.case_id:<{width}}  {case.status or 'run':<11}  {first:5.0f}s  "
              f"{full:5.0f}s  {case.reason}", file=stream)
    candidates = space.candidates
    sweep = sum(case_seconds(c, rig) for c in candidates)
    rung0 = sum(case_seconds(race_launch(c, space.profile.measurement), rig)
                for c in candidates)
    budget = min(settings.budget_s, (settings.budget_fraction or math.inf) * sweep)
    sizes = " -> ".join(map(str, halving_sizes(len(candidates), settings)))
    print(f"{len(space.cases)} cases ({len(candidates)} candidates) of {space.describe()} "
          f"on rig {rig.label}", file=stream)
    print(f"exhaustive sweep ({space.profile.measurement.launches} launches each): "
          f"~{format_duration(sweep)} estimated", file=stream)
    print(f"race: short launches (warm-up >= {RACE_WARMUP_STEPS}, <= {RACE_TIMED_STEPS} "
          f"timed steps, {RACE_MAX_TIME_S:g} s cap); rung 0 {len(candidates)} of them "
          f"~{format_duration(rung0)}; then halving {sizes} at most, single in every rung; "
          f"budget ~{format_duration(budget)} of launches (rough: recomputed from rung 0's "
          "measured launches), which cuts later rungs to the best that fit", file=stream)


def settings_dict(settings: RaceSettings, seed: int, space: Space,
                  refused: dict[str, str]) -> dict[str, Any]:
    """env.json's ``tune``: how the race was set up."""
    return {"eta": settings.eta, "min_keep": settings.min_keep,
            "max_rungs": settings.max_rungs,
            "budget_s": None if math.isinf(settings.budget_s) else settings.budget_s,
            "budget_fraction": settings.budget_fraction,
            "sweep_launches": settings.sweep_launches,
            "sweep_over_race": settings.sweep_over_race,
            "confidence": settings.confidence, "look_confidence": settings.look_confidence,
            "seed": seed,
            "race_launch": {"warmup_steps": RACE_WARMUP_STEPS,
                            "timed_steps": RACE_TIMED_STEPS, "max_time_s": RACE_MAX_TIME_S,
                            "min_time_s": 0.0},
            "candidates": [c.case_id for c in space.candidates],
            "not_run": {c.case_id: f"{c.status}: {c.reason}" for c in space.not_run},
            "predicted_oom": refused}


def write_cases(run_dir: Path, space: Space, rig: Rig, admitted: list[Case],
                outcomes: dict[int, list[CaseOutcome]], refused: dict[str, str],
                slow: dict[str, str] | None = None,
                predicted: Mapping[str, Bound | str] | None = None) -> None:
    """cases.csv and steps.csv: one row per case of the space (``rows.rows.case_row``),
    speedups against ``single`` paired by rung (``SpeedupTable``: single first); ``slow``:
    the cases skipped as predicted too slow (``skipped``, with why); ``predicted``: each
    case's predicted step (``step_time_s_predicted`` and its error)."""
    from bench_lib.prediction.predictor import prediction_columns
    from bench_lib.results.store import RunWriter
    from bench_lib.rows.rows import case_row, step_rows
    from bench_lib.rows.speedup_table import SpeedupTable

    index = {c.case_id: i for i, c in enumerate(admitted)}
    speedups = SpeedupTable()
    with RunWriter(run_dir) as writer:
        for case in space.cases:
            if case.status is not None:
                outcome = CaseOutcome(case.status, case.reason)
            elif case.case_id in refused:
                outcome = CaseOutcome("oom", refused[case.case_id])
            elif case.case_id in (slow or {}):
                outcome = CaseOutcome("skipped", (slow or {})[case.case_id])
            else:
                outcome = CaseOutcome.of_launches(outcomes[index[case.case_id]])
            row = case_row(case, rig, outcome)
            speedups.fill(case, row)
            found = (predicted or {}).get(case.case_id)
            if found is not None:
                row |= prediction_columns(case.batch_size, case.workload_batch, found, "",
                                          row.get("step_time_s_median"))
            writer.write_case(row, step_rows(outcome), samples=outcome.samples)


def _interval(speedup: LaunchInterval | None, confidence: float) -> dict[str, Any] | None:
    if speedup is None:
        return None
    finite = not math.isnan(speedup.low)
    return {"point": speedup.point, "low": speedup.low if finite else None,
            "high": speedup.high if finite else None, "confidence": confidence,
            "rounds": speedup.n, "note": speedup.note}


def tune_json(result: RaceResult, admitted: list[Case], space: Space, rig: Rig,
              settings: RaceSettings, plan: TunePlan, wall_s: float) -> dict[str, Any]:
    """tune.json (module docstring)."""
    ids = [c.case_id for c in admitted]
    win, second = result.winner, result.runner_up
    ref = next((i for i, c in enumerate(admitted) if c.strategy == "single"), None)
    vs_single = (result.speedup(win, ref) if win is not None and ref is not None
                 and win != ref else None)
    vs_second = (result.speedup(win, second, settings.look_confidence)
                 if win is not None and second is not None else None)
    command = (reproduce_command(admitted[win], plan.profile, space.profile, rig,
                                 plan.measurement_flags) if win is not None else [])
    return {
        "verdict": result.verdict, "stop_reason": result.stop_reason,
        "winner": ids[win] if win is not None else None,
        "runner_up": ids[second] if second is not None else None,
        "tie": [ids[i] for i in result.tie],
        "speedup_vs_single": _interval(vs_single, CI_CONFIDENCE),
        "speedup_vs_runner_up": _interval(vs_second, settings.look_confidence),
        "command": shlex.join(command),
        "ranking": [{"case_id": ids[i], "step_time_s": result.step_time_s(i),
                     "launches": len(result.medians(i))} for i in result.ranking],
        "rungs": [[ids[i] for i in rung] for rung in result.rungs],
        "launches": len(result.records), "launch_seconds": round(result.spent_s, 2),
        "budget_s": None if math.isinf(result.budget_s) else round(result.budget_s, 2),
        "wall_time_s": round(wall_s, 2),
    }


def _fmt(iv: dict[str, Any] | None) -> str:
    if iv is None:
        return "none"
    span = (f" [{iv['low']:.2f}, {iv['high']:.2f}] ({iv['confidence']:.1%}, paired over "
            f"{iv['rounds']} rungs)" if iv["low"] is not None
            else f" (no interval: {iv['rounds']} paired rung; an interval needs 2)")
    return f"{iv['point']:.2f}x{span}"


def result_lines(s: dict[str, Any]) -> list[str]:
    """The recommendation as printed."""
    if s["winner"] is None:
        return [f"no recommendation: {s['stop_reason']}"]
    best = s["ranking"][0]
    vs_single = _fmt(s["speedup_vs_single"]) if s["speedup_vs_single"] else "it is single"
    lines = [f"recommendation: {s['winner']} ({best['step_time_s']:.4g} s/step over "
             f"{best['launches']} launches)", f"  vs single: {vs_single}"]
    if s["runner_up"] is None:
        lines.append(f"  vs runner-up: none ({s['stop_reason']})")
    elif s["verdict"] == "separated":
        lines.append(f"  vs runner-up {s['runner_up']}: separated, "
                     f"{_fmt(s['speedup_vs_runner_up'])}")
    else:
        lines.append(f"  vs runner-up {s['runner_up']}: TIE, {_fmt(s['speedup_vs_runner_up'])}"
                     f"; tied: {', '.join(s['tie'])}")
    budget = "" if s["budget_s"] is None else f" of a {s['budget_s']:.0f} s budget"
    lines += [f"  stopped: {s['stop_reason']}",
              f"  reproduce: {s['command']}",
              f"  {s['launches']} launches, {s['launch_seconds']:.0f} s of launches{budget}; "
              f"tune took {format_duration(s['wall_time_s'])}"]
    return lines
