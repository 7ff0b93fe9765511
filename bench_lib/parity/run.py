"""``python -m bench_lib parity``: train every strategy of every model on the same data from
the same weights, and say whether each ends where ``single`` ends.

Per model: ``single`` in float64 first (the rounding reference, ``parity.verdict``), then
each strategy in float32, ``single`` first, each in fresh processes (``parity.train``) with
the rig's pinning, as a case runs. Which strategies can run is decided as for a sweep
(``sweep.cases.new_case``: ``dp`` needs CUDA, a model too small to cut is ``unsupported``)
and recorded with the reason. Writes ``parity.csv`` (every epoch of every run) and
``parity_verdicts.csv`` into a run folder with its ``env.json``; exits 1 when a strategy
diverged or failed.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_lib import strategies
from bench_lib.parity.data import dataset
from bench_lib.parity.train import EpochResult, ParitySpec, result_path
from bench_lib.parity.verdict import Final, Tolerance, judge, tolerance
from bench_lib.results.schema import PARITY_COLUMNS, PARITY_VERDICT_COLUMNS
from bench_lib.rig import Rig
from bench_lib.sweep.cases import Case, model_facts, new_case
from bench_lib.sweep.profile import UsageError
from bench_lib.workloads import MODELS, Workload

DEFAULT_MODELS = ("mlp", "toy")
DEFAULT_STRATEGIES = ("single", "ddp", "mp", "pipeline", "accum", "gpipe", "1f1b")
NOT_YET = {"fsdp": "parity cannot yet read FSDP2's sharded parameters back into one model "
                   "for its evaluation"}
"""Strategies that could train but that parity cannot evaluate yet, and why."""
RUN_TIMEOUT_S = 600.0
POLL_S = 0.1
Row = dict[str, Any]


@dataclass(frozen=True)
class ParityPlan:
    """A parity run, validated: its models, strategies and training settings."""

    models: tuple[str, ...]
    strategies: tuple[str, ...]
    epochs: int
    batch_size: int
    split_size: int
    lr: float
    seed: int

    def __post_init__(self) -> None:
        for model in self.models:
            if model not in MODELS:
                raise UsageError(f"unknown model {model!r}; valid: {', '.join(sorted(MODELS))}")
            if model_facts(model).batch_norm:
                raise UsageError(f"parity judges BatchNorm-free models so far ({model} has "
                                 "BatchNorm); valid: mlp, toy")
        for name in self.strategies:
            strategies.get(name)  # a ValueError naming the known ones
        if "single" not in self.strategies:
            raise UsageError("parity compares every strategy with single: include it")
        if min(self.epochs, self.batch_size, self.split_size) < 1 or self.lr <= 0:
            raise UsageError("epochs, batch size and split size must be >= 1 and lr > 0")
        if self.split_size > self.batch_size:
            raise UsageError(f"split size {self.split_size} is larger than batch size "
                             f"{self.batch_size}")


def _launch(spec: ParitySpec, workdir: Path, processes: int) -> tuple[list[EpochResult], str]:
    """Run ``spec`` in fresh rank processes; its epochs, or none and why."""
    workdir.mkdir(parents=True)
    spec.write(workdir / "spec.json")
    with (workdir / "log.txt").open("ab") as log:
        procs = [subprocess.Popen([sys.executable, "-m", "bench_lib.parity.train",
                                   str(workdir / "spec.json"), str(rank)],
                                  stdout=log, stderr=subprocess.STDOUT)
                 for rank in range(processes)]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            time.sleep(5 * POLL_S)  # its peers get a moment to fail on their own
            break
        time.sleep(POLL_S)
    for p in procs:  # peers of a failed rank, or a run past its time
        if p.poll() is None:
            p.kill()
        p.wait()
    errors = [json.loads(f.read_text())["error"] for f in sorted(workdir.glob("error*.json"))]
    if errors:
        return [], errors[0]
    if not result_path(workdir).exists():
        codes = [p.returncode for p in procs]
        return [], f"no result (exit codes {codes}; past {RUN_TIMEOUT_S:g} s?)"
    data = json.loads(result_path(workdir).read_text())
    return [EpochResult(**e) for e in data["epochs"]], ""


def _append(path: Path, columns: Sequence[str], rows: Sequence[Row]) -> None:
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        if new:
            writer.writeheader()
        writer.writerows([{k: ("" if v is None else v) for k, v in r.items()} for r in rows])


def _spec(plan: ParityPlan, rig: Rig, model: str, case: Case, precision: str) -> ParitySpec:
    return ParitySpec(model, case.strategy, rig, case.processes, plan.epochs, plan.batch_size,
                      plan.split_size, plan.lr, plan.seed, precision)


def run_model(plan: ParityPlan, rig: Rig, model: str, run_dir: Path) -> list[Row]:
    """Every strategy of ``model``: its epochs into parity.csv; returns its verdict rows."""
    run_id = run_dir.name
    cases = [new_case(rig, name, model, 0, plan.batch_size, split_size=plan.split_size)
             for name in sorted(plan.strategies, key=lambda s: s != "single")]
    runs: dict[str, list[Final]] = {}
    verdicts: list[Row] = []
    test_size = len(dataset(Workload(model), plan.seed).y_test)
    tol: Tolerance | None = None
    for precision, case in [("fp64", cases[0]), *(("fp32", c) for c in cases)]:
        base = {"run_id": run_id, "model": model, "strategy": case.strategy,
                "world_size": case.world_size}
        reason = case.reason or NOT_YET.get(case.strategy, "")
        if reason:
            verdicts.append(base | {"verdict": case.status or "unsupported", "reason": reason})
            continue
        label = f"{model}_{case.strategy}_{precision}"
        epochs, error = _launch(_spec(plan, rig, model, case, precision),
                                run_dir / "parity" / label, case.processes)
        _append(run_dir / "parity.csv", PARITY_COLUMNS,
                [base | {"precision": precision} | dataclasses.asdict(e) for e in epochs])
        if error or not epochs:
            verdicts.append(base | {"verdict": "error", "reason": error})
            continue
        run = [Final(e.test_loss, e.test_accuracy) for e in epochs]
        final = run[-1]
        figures = base | {"test_loss": final.test_loss, "test_accuracy": final.test_accuracy}
        if precision == "fp64":
            runs["fp64"] = run
        elif case.strategy == "single":
            runs["single"] = run
            if "fp64" in runs:
                tol = tolerance(run, runs["fp64"], test_size)
            verdicts.append(figures | {"verdict": "reference"} | _tolerance_columns(tol))
        elif tol is None:
            verdicts.append(figures | {"verdict": "error",
                                       "reason": "no single reference to compare with"})
        else:
            j = judge(final, runs["single"][-1], tol)
            verdicts.append(figures | {"verdict": j.verdict, "test_loss_diff": j.loss_diff,
                                       "test_accuracy_diff": j.accuracy_diff}
                            | _tolerance_columns(tol))
    _append(run_dir / "parity_verdicts.csv", PARITY_VERDICT_COLUMNS, verdicts)
    return verdicts


def _tolerance_columns(tol: Tolerance | None) -> Row:
    if tol is None:
        return {}
    return {"loss_tolerance": tol.loss, "accuracy_tolerance": tol.accuracy,
            "tolerance_note": tol.note}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``parity`` command's flags (the rig flags are the caller's)."""
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help=f"comma-separated BatchNorm-free models (default: "
                        f"{','.join(DEFAULT_MODELS)})")
    p.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                   help=f"comma-separated, with single (default: {','.join(DEFAULT_STRATEGIES)})")
    p.add_argument("--epochs", type=int, default=10, help="training epochs (default 10)")
    p.add_argument("--batch-size", type=int, default=32, help="global batch size (default 32)")
    p.add_argument("--split-size", type=int, default=8,
                   help="micro-batch size of the strategies that split the batch (default 8)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the weights, the split and the shuffles (default 0)")
    p.add_argument("--out", type=Path, default=Path("results"),
                   help="folder that receives the run folder (default: results)")


def plan_of(args: argparse.Namespace) -> ParityPlan:
    """The validated plan of the command's flags (UsageError: exit 2, nothing written)."""
    names = [tuple(v.strip() for v in text.split(",") if v.strip())
             for text in (args.models, args.strategies)]
    try:
        return ParityPlan(names[0], names[1], args.epochs, args.batch_size, args.split_size,
                          args.lr, args.seed)
    except ValueError as e:
        raise UsageError(str(e)) from None


def command(args: argparse.Namespace, rig: Rig) -> int:
    """Run the plan on ``rig`` into a new run folder; 1 when a strategy diverged or failed."""
    from bench_lib.measure import environment
    from bench_lib.results.store import create_run_dir, new_run_id, write_json_atomic

    plan = plan_of(args)
    run_dir = create_run_dir(args.out, new_run_id(environment.git_info()["sha"]))
    write_json_atomic(run_dir / "env.json", environment.collect(
        rig, {"parity": dataclasses.asdict(plan)}, sys.argv))
    verdicts = [v for model in plan.models for v in run_model(plan, rig, model, run_dir)]
    for v in verdicts:
        loss = f"{v['test_loss']:.6g}" if v.get("test_loss") is not None else "-"
        print(f"{v['model']:<6} {v['strategy']:<10} {v['verdict']:<11} test loss {loss:<12} "
              f"{v.get('reason', '')}", file=sys.stderr)
    print(run_dir)
    return 1 if any(v["verdict"] in ("diverged", "error") for v in verdicts) else 0
