"""``run --dry-run``: the plan's table, with predicted memory (``--predict-memory``) or
predicted step times after a calibration (``--predict``); nothing is written."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench_lib.exit_codes import EXIT_OK

if TYPE_CHECKING:
    from bench_lib.prediction.calibration_file import GivenCalibrations
    from bench_lib.prediction.fixed_costs import FixedCosts, ImpliedRange
    from bench_lib.rig import Rig
    from bench_lib.sweep.cases import Case


def this_box_terms(rig: Rig, results: Path) -> FixedCosts:
    """The estimate's terms for ``rig``: the rig kind's, renewed from this machine's newest
    run under ``results`` (``fixed_costs.this_box``: this machine as
    ``prediction.calibration_file.hardware_id`` names it; NCCL's group from the launches of the
    strategies with a process per device)."""
    from bench_lib import strategies
    from bench_lib.prediction.calibration_file import hardware_id
    from bench_lib.prediction.fixed_costs import this_box

    groups = {n for n, s in strategies.REGISTRY.items() if s.per_device_processes}
    return this_box(results, rig.kind, lambda: hardware_id(rig), groups)


def terms_lines(terms: FixedCosts, kind: str, implied: ImpliedRange) -> list[str]:
    """Where the estimate's terms come from, as the dry run prints it::

        terms from this box's run 20261201T101010Z_box_abc1234_run-gpu-check: launch ...
        terms from one H100 (one GPU), 2026-11-26, another machine: calibration per size
          they imply 40.1 min to 46.3 min: each from 0.5x to 2x its figure; ...

    (the last two only where a term of another machine counts in the total)."""
    from bench_lib.prediction.duration import format_duration as f
    from bench_lib.prediction.fixed_costs import (
        ELSEWHERE_FACTORS,
        ELSEWHERE_RANGES_S,
        TERM_WORDS,
        TERMS,
    )

    here: dict[str, list[str]] = {}
    for term in TERMS:
        if term in terms.here:
            here.setdefault(terms.here[term], []).append(TERM_WORDS[term])
    out = [f"terms from {where}: {', '.join(words)}" for where, words in here.items()]
    if implied.applied:
        special = ELSEWHERE_RANGES_S.get(kind, {})
        rule = (f"each from {ELSEWHERE_FACTORS[0]:g}x to {ELSEWHERE_FACTORS[1]:g}x its figure"
                + "".join(f", {TERM_WORDS[k]} {words}" for k, (_, _, words)
                          in special.items() if k in implied.applied)
                + "; the steps' own seconds as estimated")
        out += [f"terms from {terms.measured_on}, another machine: "
                f"{', '.join(TERM_WORDS[k] for k in implied.applied)}",
                f"  they imply {f(implied.low_s)} to {f(implied.high_s)}: {rule}"]
    return out


def print_plan(cases: list[Case], rig: Rig, predict_memory: bool = False,
               rig_figures: bool = True, predict_time: bool = False,
               results: Path = Path("results")) -> None:
    """The dry run's table: each case, what will happen to it, its estimated time and
    (``predict_memory``) its peak memory per device predicted as the run would before
    launching it (a case the run would refuse is shown ``oom``, with the reason); then the
    run's estimate, part by part (``duration.run_estimate``: the rig figures where
    ``rig_figures``, calibrations where ``predict_time``), and where its terms come from:
    this machine's newest run under ``results`` (``this_box_terms``), else another
    machine, with the range that implies (``terms_lines``)."""
    from bench_lib.prediction.admission import Admission
    from bench_lib.prediction.duration import case_seconds, format_duration, run_estimate
    from bench_lib.prediction.fixed_costs import implied_range

    admission = Admission.of(rig, cases, read_devices=False)
    terms = this_box_terms(rig, results)
    runnable = [c for c in cases if c.status is None] if predict_memory else []
    if runnable:
        print(f"predicting the peak memory of {len(runnable)} cases ...", file=sys.stderr,
              flush=True)
    width = max((len(c.case_id) for c in cases), default=10)
    print(f"{'case':<{width}}  {'will':<11}  estimate  {'peak MiB per device':<21}  reason")
    runs, planned = 0, []
    for case in cases:
        will, reason, peak = case.status or "run", case.reason, ""
        est = case_seconds(case, rig, terms)
        if case.status is None and predict_memory:
            pred = admission.prediction(case)
            if isinstance(pred, str):  # not predicted: the case still runs
                peak, reason = "-", pred
            else:
                peak = pred.per_device_text()
            refusal = admission.refusal(case)
            if refusal:
                will, reason, est = "oom", refusal, 0.0
                case = dataclasses.replace(case, status="oom", reason=refusal)
        runs += will == "run"
        planned.append(case)
        print(f"{case.case_id:<{width}}  {will:<11}  {est:7.0f}s  {peak:<21}  {reason}")
    run = run_estimate(planned, rig, rig_figures, predict_time, terms)
    print(f"{len(cases)} cases ({runs} to run) on rig {rig.label}; estimated duration "
          f"~{format_duration(run.total_s)} (the progress bar refines it)")
    print(run.parts_line())
    implied = implied_range(terms, rig.kind, lambda t: run_estimate(
        planned, rig, rig_figures, predict_time, t).total_s)
    print("\n".join(terms_lines(terms, rig.kind, implied)))
    if predict_memory:
        print("peak MiB: predicted before launch on fake tensors "
              "(bench_lib/prediction/memory.py; "
              "'balanced' cuts from counted FLOPs until a launch measures them)"
              + (f"; {admission.note}" if admission.note else ""))
    else:
        print("peak MiB per device: add --predict-memory")


def print_predictions(cases: list[Case], rig: Rig, stack: contextlib.ExitStack,
                       quiet: bool = False, given: GivenCalibrations | None = None) -> int:
    """``run --dry-run --predict``: every workload calibrated (and the collectives measured)
    as a run would, then each case's predicted step time, speedup and peak memory, and each
    workload's predicted best; nothing written. On a cuda rig this machine cannot drive,
    says what it cannot predict and predicts memory alone."""
    import tempfile
    import time

    from bench_lib.launch.agent import WARM_MODULES
    from bench_lib.prediction.admission import Admission
    from bench_lib.prediction.calibration import describe_calibration
    from bench_lib.prediction.collectives import sweep_collectives
    from bench_lib.prediction.predictor import Predictor
    from bench_lib.prediction.step_time import speedup
    from bench_lib.processes.forkserver import ForkServer
    from bench_lib.rig_detection import cuda_device_count

    start = time.monotonic()
    admission = Admission.of(rig, cases, read_devices=False)
    runnable = [c for c in cases if c.status is None]
    predictor = None
    if rig.kind == "cuda" and cuda_device_count() < rig.num_devices:
        print(f"step times not predicted: the calibration times steps on the rig's devices, "
              f"and this machine has {cuda_device_count()} GPU(s) of the {rig.num_devices} "
              "the rig names; peak memory is predicted on fake tensors all the same",
              file=sys.stderr)
    elif runnable:
        server = stack.enter_context(ForkServer.take(WARM_MODULES))
        collectives = sweep_collectives(rig, quiet, runnable, server)
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="parabench-")))
        predictor = Predictor(runnable, rig, folder, collectives, server,
                              lambda key, cal: print(describe_calibration(key, cal),
                                                     file=sys.stderr, flush=True), given)
        if not quiet:
            print(f"calibrating {len(predictor.sizes)} workload(s) ...", file=sys.stderr,
                  flush=True)
    width = max((len(c.case_id) for c in cases), default=10)
    print(f"{'case':<{width}}  {'will':<11}  {'step s':>7}  {'speedup':>7}  "
          f"{'peak MiB per device':<21}  note")
    best: dict[tuple[Any, ...], tuple[float, Case]] = {}
    for case in cases:
        will, step, gain, peak, note = case.status or "run", "-", "-", "", case.reason
        if case.status is None:
            memory = admission.prediction(case)
            peak = "-" if isinstance(memory, str) else memory.per_device_text()
            if refusal := admission.refusal(case):
                will, note = "oom", refusal
            elif predictor is not None:
                found, single = predictor.predict(case)
                if isinstance(found, str):
                    note = found
                else:
                    step, note = f"{found.step_s:.3f}", found.note()
                    if not isinstance(single, str) and case.curve_of is None:
                        x = speedup(found.step_s, case.batch_size, single.step_s,
                                    case.workload_batch)
                        gain = f"{x:.2f}x"
                        key = (*case.workload_key, case.scaling)
                        if key not in best or x > best[key][0]:
                            best[key] = (x, case)
        print(f"{case.case_id:<{width}}  {will:<11}  {step:>7}  {gain:>7}  {peak:<21}  {note}")
    for (model, image, batch, _, _, scaling), (x, case) in best.items():
        print(f"predicted best for {model} {image} px batch {batch} ({scaling}): "
              f"{case.strategy} {x:.2f}x single ({case.case_id})")
    print(f"{len(cases)} cases on rig {rig.label}; predicted in "
          f"{time.monotonic() - start:.0f} s (prediction.step_time states each formula)")
    return EXIT_OK
