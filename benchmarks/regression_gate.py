"""Show that the regression gate is right on this machine: A/A runs pass, a planted slowdown fails.

    python benchmarks/regression_gate.py [--pairs 5] [--slowdown 0.15] [-- RUN ARGS...]

Runs a chain of real sweeps, alternating plain runs and runs with the test-only hook
PARABENCH_INJECT_SLOWDOWN (every timed step does that fraction more work):

    plain0  slow1  plain2  slow3  plain4 ...

A/A comparison k is plain(2k) vs plain(2k+2); planted comparison k is plain(2k) vs slow(2k+1).
Neighbours in time are compared, as a CI job compares against a baseline taken recently; a
gate that only passes on a quiet machine would fail here, since the CPU is shared.
Arguments after ``--`` go to ``python -m bench_lib run`` (default: the ci profile, each case
in 3 launches, so the gate's intervals are Welch's over launches; ``--launches 1`` gets the
bootstrap over steps instead, and each line says which).

The last line sums it up: A/A pairs passed, planted slowdowns caught, and the median
half-width of the intervals that decided the verdicts (every case's deciding change, over
all comparisons): how small a change this machine and this many launches can resolve.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_lib.compare import verdicts as cmp
from bench_lib.compare.runs import load_run
from bench_lib.fault_hooks import INJECT_SLOWDOWN_ENV
from bench_lib.results.read import run_dirs_in


def run_sweep(out: Path, run_args: list[str], slowdown: float) -> Path:
    """One real sweep into the fresh folder ``out``; returns its run folder."""
    env = dict(os.environ, **{INJECT_SLOWDOWN_ENV: str(slowdown)})
    cmd = [sys.executable, "-m", "bench_lib", "run", "--out", str(out), "--quiet", *run_args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    runs = run_dirs_in(out)
    if proc.returncode != 0 or len(runs) != 1:
        sys.exit(f"run failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    return runs[0]


def judge(base: Path, cand: Path, threshold: float) -> list[cmp.CaseResult]:
    """The gate's verdicts for one pair of run folders."""
    return cmp.compare_runs(load_run(base), load_run(cand), threshold)


def deciding(results: list[cmp.CaseResult]) -> list[cmp.Change]:
    """The change behind each case's verdict (none for a broken or n/a case)."""
    return [r.changes[r.by] for r in results if r.by in r.changes]


def describe(kind: str, k: int, results: list[cmp.CaseResult]) -> str:
    """One line: the pair, the gate's answer, each case's deciding change with its interval
    and verdict, and the intervals' method."""
    parts = []
    for r in results:
        change = r.changes.get(r.by)
        shown = (f"{r.by} {change.value:+.1%} [{change.ci_low:+.1%}, {change.ci_high:+.1%}]"
                 if change else "-")
        parts.append(f"{r.strategy} {shown} {r.verdict}")
    methods = sorted({c.method for c in deciding(results)})
    word = "FAIL" if cmp.exit_code(results) else "pass"
    return (f"{kind} #{k + 1}: {word}  (" + "; ".join(parts) + ")"
            + (f"  [{'; '.join(methods)}]" if methods else ""))


def summary(pairs: int, aa_passed: int, planted_caught: int, slowdown: float,
            threshold: float, changes: list[cmp.Change]) -> str:
    """The closing line: A/A passes, planted slowdowns caught, the intervals' median
    half-width and the methods behind them."""
    widths = [c.half_width for c in changes if not math.isnan(c.half_width)]
    width = (f"median half-width of the gate's intervals {statistics.median(widths):.1%} "
             f"(over {len(widths)})" if widths else "no gate intervals")
    methods = ", ".join(sorted({c.method for c in changes})) or "none"
    return (f"A/A: {aa_passed}/{pairs} passed (no false regression); planted {slowdown:.0%} "
            f"slowdown: {planted_caught}/{pairs} caught; {width}; intervals: {methods}; "
            f"threshold {threshold:g}%")


def main(argv: list[str]) -> int:
    split = argv.index("--") if "--" in argv else len(argv)
    own, run_args = argv[:split], argv[split + 1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=5, help="A/A and planted comparisons each")
    p.add_argument("--slowdown", type=float, default=0.15, help="planted slowdown (fraction)")
    p.add_argument("--threshold-pct", type=float, default=cmp.DEFAULT_THRESHOLD_PCT,
                   help="the gate's threshold in percent")
    p.add_argument("--out", type=Path, help="where the run folders go (default: a temp dir)")
    args = p.parse_args(own)
    run_args = run_args or ["--profile", "ci"]
    out = args.out or Path(tempfile.mkdtemp(prefix="regression-gate-"))
    print(f"run folders under {out}; run args: {' '.join(run_args)}", flush=True)

    plain = [run_sweep(out / "plain0", run_args, 0.0)]
    aa_fail = planted_caught = 0
    gate_changes: list[cmp.Change] = []
    for k in range(args.pairs):
        slow = run_sweep(out / f"slow{2 * k + 1}", run_args, args.slowdown)
        plain.append(run_sweep(out / f"plain{2 * k + 2}", run_args, 0.0))
        aa = judge(plain[k], plain[k + 1], args.threshold_pct)
        planted = judge(plain[k], slow, args.threshold_pct)
        aa_fail += bool(cmp.exit_code(aa))
        planted_caught += bool(cmp.exit_code(planted))
        gate_changes += deciding(aa) + deciding(planted)
        print(describe("A/A", k, aa), flush=True)
        print(describe(f"planted {args.slowdown:.0%}", k, planted), flush=True)
    print(summary(args.pairs, args.pairs - aa_fail, planted_caught, args.slowdown,
                  args.threshold_pct, gate_changes), flush=True)
    return 0 if aa_fail == 0 and planted_caught == args.pairs else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
