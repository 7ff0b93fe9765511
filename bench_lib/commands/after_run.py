"""What ``run`` does with the run folder it wrote (``--report``, ``--compare-to``,
``--save-baseline``), the checks of those targets made before the sweep starts, and the
reports ``--report`` writes while it runs (after which rounds: ``report_due``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from bench_lib.exit_codes import EXIT_OK

if TYPE_CHECKING:
    from bench_lib.rig import Rig
    from bench_lib.rows.workload_rows import RoundDone


def check_after_run_targets(args: argparse.Namespace, rig: Rig, multi_node: bool = False
                            ) -> None:
    """``--compare-to`` and ``--save-baseline`` checked before the sweep (and in a dry run),
    not after it (UsageError: exit 2): a baseline that is not there, a store or run folder
    without this hardware's baseline, and a store that cannot be written. (A dry run that
    plans GPUs it does not have cannot name their hardware, nor one node a cluster's: there,
    only the path is checked.)"""
    import os

    from bench_lib.sweep.profile import UsageError

    given = [flag for flag, value in (("--threshold-pct", args.threshold_pct),
                                      ("--metric", args.metric),
                                      ("--allow-different-hardware",
                                       args.allow_different_hardware or None))
             if value is not None]
    if given and args.compare_to is None:
        raise UsageError(f"{', '.join(given)} go with --compare-to")
    if args.threshold_pct is not None and not args.threshold_pct >= 0:
        raise UsageError(f"--threshold-pct must be a percentage >= 0, got {args.threshold_pct}")
    if args.compare_to is not None:
        from bench_lib.compare.baseline import resolve_baseline, stored_hardware
        from bench_lib.compare.runs import CompareError, Run
        from bench_lib.measure.environment import hardware_fingerprint
        from bench_lib.results.fingerprint import fingerprint_id, hardware_of

        path, advice = args.compare_to, ("record one on this machine with `make baseline`, or "
                                         "measure base and head in one job with `make gate`, "
                                         "which needs no stored baseline")
        if not path.exists():
            raise UsageError(f"--compare-to {path} does not exist: {advice}")
        if ((not args.dry_run or rig.kind == "cpu") and not multi_node
                and not args.allow_different_hardware):
            mine = hardware_of(hardware_fingerprint(rig))
            try:
                found = resolve_baseline(path, Run(path, {"fingerprint": mine}, {}, {}), False)
            except CompareError:
                found = None
            theirs = stored_hardware(found) if found is not None else None
            if theirs is None:
                raise UsageError(f"--compare-to {path}: no baseline of this machine's hardware "
                                 f"(fingerprint {fingerprint_id(mine)}: {mine['rig']}, "
                                 f"{mine['cpu_model']}) is there; {advice}")
            differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            if differ:
                raise UsageError(f"--compare-to {path} was measured on other hardware "
                                 f"({', '.join(differ)} differ); {advice}")
    if args.save_baseline is not None:
        target = args.save_baseline.resolve()
        existing = next(p for p in (target, *target.parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise UsageError(f"--save-baseline {args.save_baseline}: {existing} is not a "
                             "folder this user can write")


def report_due(done: RoundDone) -> bool:
    """Whether ``--report`` writes the report after this round: after a workload's first
    round only, since a report costs seconds that a round of a few launches would feel
    (the first gives the workload's answer early; the next workload's first round shows
    this one's final figures, and the run's end writes the last one's)."""
    return not done.last and done.round_done == 1


def interim_report(run_dir: Path, when: str) -> str:
    """Write the report of a run still going (``run --report`` after a workload's round;
    provisional rows say so on the page), and a line saying where, or why not: a report
    that fails here costs the line, not the run (the run's end writes it again)."""
    from bench_lib.report.build import write_report
    from bench_lib.results.schema import ResultsError

    try:
        return f"report ({when}): {write_report([run_dir])}"
    except (ResultsError, OSError, ValueError) as e:
        return f"report ({when}) not written: {type(e).__name__}: {e}"


def after_run(args: argparse.Namespace, run_dir: Path) -> int:
    """The post-sweep actions asked for, on the run folder just written; their exit code."""
    code = EXIT_OK
    if args.report:
        from bench_lib.report.build import write_report

        print(f"report: {write_report([run_dir])}", file=sys.stderr)
    if args.compare_to:
        from bench_lib.compare.output import run_compare
        from bench_lib.compare.plan import ComparePlan
        from bench_lib.compare.verdicts import DEFAULT_THRESHOLD_PCT

        code = run_compare(ComparePlan(
            args.compare_to, run_dir, markdown=run_dir / "compare.md",
            json_path=run_dir / "compare.json",
            threshold_pct=(DEFAULT_THRESHOLD_PCT if args.threshold_pct is None
                           else args.threshold_pct),
            metric=args.metric or "auto",
            allow_different_hardware=args.allow_different_hardware))
    if args.save_baseline:
        from bench_lib.compare.baseline import save_baseline

        print(f"baseline: {save_baseline(run_dir, args.save_baseline)}", file=sys.stderr)
    return code

