"""``python -m bench_lib parity``: train every strategy of every model on the same data from
the same weights, and say whether each ends where the strategy computing its mathematics
ends (``parity.verdict``).

Per model: ``single`` in float64 (the rounding reference) and in float32, on a BatchNorm
model ``single`` at ``--seed-runs`` further seeds too (the seeds tolerance), and each other
strategy in float32, each in fresh processes (``parity.train``) with the rig's
pinning, as a case runs (on a cpu rig the one-process runs go side by side, one per
worker: ``parity.launch``). Which strategies can run is decided as for a sweep
(``sweep.cases.new_case``: ``dp`` needs CUDA, a model too small to cut and SyncBatchNorm on a
cpu rig are ``unsupported``) and recorded with the reason. Writes ``parity.csv`` (every
epoch of every run) and ``parity_verdicts.csv`` into a run folder with its ``env.json``;
exits 1 when a strategy diverged or failed.

The defaults (``DEFAULTS``) are the run ``make parity`` makes: ``mlp``, ``toy`` and
``resnet-tiny`` on the digits, every strategy a 2-worker cpu rig can run, a few minutes on
2 CPU cores (docs/parity.md).
"""

from __future__ import annotations

import csv
import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_lib import strategies
from bench_lib.exit_codes import EXIT_NOT_OK, EXIT_OK
from bench_lib.parity.data import IMAGE_SIZE, dataset, parity_workload
from bench_lib.parity.launch import Job, Outcome, launch_all
from bench_lib.parity.plan import ParityPlan
from bench_lib.parity.train import ParitySpec
from bench_lib.parity.verdict import (
    Final,
    Tolerance,
    bn_statistics,
    judge,
    reference_of,
    seeds_tolerance,
    tighter,
    tolerance,
)
from bench_lib.results.schema import PARITY_COLUMNS, PARITY_VERDICT_COLUMNS
from bench_lib.rig import Rig
from bench_lib.sweep.cases import Case, new_case
from bench_lib.sweep.refusals import model_facts

DEFAULT_MODELS = ("mlp", "toy", "resnet-tiny")
DEFAULT_STRATEGIES = ("single", "ddp", "fsdp", "mp", "pipeline", "accum", "gpipe", "1f1b")
DEFAULTS = {"epochs": 5, "seed_runs": 3}
"""Defaults of the other flags that docs/parity.md and ``parity.verdict`` speak of."""
Row = dict[str, Any]
Key = tuple[str, str, int]
"""A training run of a model: (strategy, precision, seed)."""


def _append(path: Path, columns: Sequence[str], rows: Sequence[Row]) -> None:
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        if new:
            writer.writeheader()
        writer.writerows([{k: ("" if v is None else v) for k, v in r.items()} for r in rows])


@dataclass(frozen=True)
class TrainingRun:
    """One training run of a parity run: a strategy at a precision and seed."""

    case: Case
    precision: str
    seed: int

    @property
    def label(self) -> str:
        """Its folder under ``parity/``, e.g. ``mlp_single_fp32`` or ``mlp_single_fp32_s2``."""
        return f"{self.case.model}_{self.case.strategy}_{self.precision}" + (
            f"_s{self.seed}" if self.case.strategy == "single" and self.precision == "fp32"
            and self.seed else "")


def _runs(plan: ParityPlan, cases: list[Case], batch_norm: bool) -> list[TrainingRun]:
    """The model's runs in order: single in float64, in float32, at its further seeds (a
    BatchNorm model), then every other runnable strategy (``single`` is ``cases[0]``)."""
    single, others = cases[0], cases[1:]
    if single.status:
        return []
    extra = plan.seed_runs if batch_norm else 0
    return ([TrainingRun(single, "fp64", plan.seed), TrainingRun(single, "fp32", plan.seed)]
            + [TrainingRun(single, "fp32", plan.seed + k) for k in range(1, extra + 1)]
            + [TrainingRun(c, "fp32", plan.seed) for c in others if not c.status])


def _spec(plan: ParityPlan, rig: Rig, run: TrainingRun) -> ParitySpec:
    case = run.case
    return ParitySpec(case.model, case.strategy, rig, case.processes, plan.epochs,
                      plan.batch_size, plan.split_size, plan.lr, run.seed, plan.seed,
                      run.precision, case.sync_bn,
                      str(plan.data_root) if plan.data_root is not None else None,
                      math_mode=plan.math_mode)


def model_runs(plan: ParityPlan, rig: Rig, model: str) -> tuple[list[Case], list[TrainingRun]]:
    """``model``'s cases (single first; a strategy this rig cannot run has its status and
    reason) and the training runs they make, in order."""
    batch_norm = model_facts(model).batch_norm
    cases = [new_case(rig, name, model, IMAGE_SIZE, plan.batch_size,
                      split_size=plan.split_size, sync_bn=plan.sync_bn and batch_norm)
             for name in sorted(plan.strategies, key=lambda s: s != "single")]
    return cases, _runs(plan, cases, batch_norm)


def run_model(plan: ParityPlan, rig: Rig, model: str, run_dir: Path) -> list[Row]:
    """Every run of ``model``: its epochs into parity.csv; returns its verdict rows."""
    batch_norm = model_facts(model).batch_norm
    cases, runs = model_runs(plan, rig, model)
    curves: dict[Key, list[Final]] = {}
    errors: dict[Key, str] = {}
    jobs = [Job(_spec(plan, rig, run), run_dir / "parity" / run.label, run.case.processes)
            for run in runs]
    print(f"parity {model}: {len(jobs)} runs ({plan.epochs} epochs each) on rig {rig.label}",
          file=sys.stderr)

    def progress(done: int, job: Job, outcome: Outcome, seconds: float) -> None:
        epochs, error = outcome
        how = (f"failed: {error.splitlines()[0] if error else 'no epoch finished'}"
               if error or not epochs else
               f"{len(epochs)} epochs, test loss {epochs[-1].test_loss:.4g}")
        print(f"  [{done}/{len(jobs)}] {job.workdir.name}: {how} ({seconds:.0f} s)",
              file=sys.stderr, flush=True)

    for run, (epochs, error) in zip(runs, launch_all(jobs, rig, progress)):
        case = run.case
        _append(run_dir / "parity.csv", PARITY_COLUMNS,
                [{"run_id": run_dir.name, "model": model, "strategy": case.strategy,
                  "precision": run.precision, "seed": run.seed,
                  "world_size": case.world_size} | dataclasses.asdict(e) for e in epochs])
        key = (case.strategy, run.precision, run.seed)
        if error or not epochs:
            errors[key] = error or "no epoch finished"
            continue
        curves[key] = [Final(e.test_loss, e.test_accuracy, e.test_loss_sd) for e in epochs]
    test_size = len(dataset(parity_workload(model, plan.batch_size), plan.seed,
                            plan.data_root).y_test)
    verdicts = _verdicts(plan, cases, batch_norm, curves, errors, test_size)
    rows = [{"run_id": run_dir.name, "model": model} | v for v in verdicts]
    _append(run_dir / "parity_verdicts.csv", PARITY_VERDICT_COLUMNS, rows)
    return rows


def _tolerances(plan: ParityPlan, curves: dict[Key, list[Final]], test_size: int
                ) -> tuple[Tolerance | None, Tolerance | None, str]:
    """The rounding and seeds tolerances of a model's runs, or None and why not."""
    single, fp64 = curves.get(("single", "fp32", plan.seed)), curves.get(
        ("single", "fp64", plan.seed))
    if single is None or fp64 is None:
        return None, None, "no single reference (float32 and float64) to compare with"
    rounding = tolerance(single, fp64, test_size)
    others = [c[-1] for (s, p, seed), c in curves.items()
              if s == "single" and p == "fp32" and seed != plan.seed]
    if not others:
        return rounding, None, "single did not finish at 2 or more seeds"
    return rounding, seeds_tolerance([single[-1], *others], test_size), ""


def _verdicts(plan: ParityPlan, cases: list[Case], batch_norm: bool,
              curves: dict[Key, list[Final]], errors: dict[Key, str], test_size: int
              ) -> list[Row]:
    """Each case's verdict row (module docstring of ``parity.verdict``)."""
    rounding, seeds, why = _tolerances(plan, curves, test_size)
    finished = [s for (s, p, seed) in curves if p == "fp32" and seed == plan.seed]
    rows = []
    for case in cases:
        stats = bn_statistics(strategies.get(case.strategy), batch_norm, case.sync_bn)
        row: Row = {"strategy": case.strategy, "world_size": case.world_size,
                    "bn_statistics": stats}
        run = curves.get((case.strategy, "fp32", plan.seed))
        if case.status:
            rows.append(row | {"verdict": case.status, "reason": case.reason})
            continue
        failed = [f"{p} seed {seed}: {e}" for (s, p, seed), e in errors.items()
                  if s == case.strategy]  # single's: its fp64 and seed runs too
        if failed or run is None:
            rows.append(row | {"verdict": "error", "reason": "; ".join(failed)})
            continue
        row |= {"test_loss": run[-1].test_loss, "test_accuracy": run[-1].test_accuracy}
        if case.strategy == "single":
            rows.append(row | {"verdict": "reference"} | _tolerance_columns(rounding))
            continue
        reference, same = reference_of(case.strategy, stats, finished)
        # The same mathematics: rounding, bounded by the seeds too (parity.verdict).
        tol = tighter(rounding, seeds) if same and rounding else seeds
        if tol is None:
            rows.append(row | {"verdict": "error", "reason": why, "compared_with": reference})
            continue
        j = judge(run[-1], curves[(reference, "fp32", plan.seed)][-1], tol)
        rows.append(row | {"verdict": j.verdict, "compared_with": reference,
                           "test_loss_diff": j.loss_diff, "test_accuracy_diff": j.accuracy_diff}
                    | _tolerance_columns(tol))
    return rows


def _tolerance_columns(tol: Tolerance | None) -> Row:
    if tol is None:
        return {}
    return {"tolerance_kind": tol.kind, "loss_tolerance": tol.loss,
            "accuracy_tolerance": tol.accuracy, "tolerance_note": tol.note}


def _verdict_line(v: Row) -> str:
    """One line of the verdict table printed at the end."""
    def num(key: str, fmt: str) -> str:
        value = v.get(key)
        return "-" if value is None else format(value, fmt)

    return (f"{v['model']:<12} {v['strategy']:<9} {v['verdict']:<11} "
            f"loss {num('test_loss', '.5f')} acc {num('test_accuracy', '.4f')} "
            f"diff {num('test_loss_diff', '.2e')} "
            f"(tol {num('loss_tolerance', '.2e')} {v.get('tolerance_kind', '')}"
            f"{' vs ' + v['compared_with'] if v.get('compared_with') else ''}) "
            f"{v.get('reason', '')}")


def run_parity(plan: ParityPlan, rig: Rig, out: Path) -> int:
    """Run the plan on ``rig`` into a new run folder under ``out``; 1 when a strategy
    diverged or failed."""
    from bench_lib.measure import environment
    from bench_lib.results.store import start_run_dir, write_json_atomic

    run_dir = start_run_dir(out, environment.git_info()["sha"], "parity")
    write_json_atomic(run_dir / "env.json", environment.collect(
        rig, {"parity": dataclasses.asdict(plan)}, sys.argv, math_mode=plan.math_mode))
    verdicts = [v for model in plan.models for v in run_model(plan, rig, model, run_dir)]
    for v in verdicts:
        print(_verdict_line(v), file=sys.stderr)
    print(run_dir)
    return EXIT_NOT_OK if any(v["verdict"] in ("diverged", "error") for v in verdicts) else EXIT_OK
