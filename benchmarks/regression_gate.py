"""Show that the regression gate is right on this machine: A/A runs pass, a planted slowdown fails.

    python benchmarks/regression_gate.py [--pairs 5] [--slowdown 0.15] [-- RUN ARGS...]

Runs a chain of real sweeps, alternating plain runs and runs with the test-only hook
PARABENCH_INJECT_SLOWDOWN (every timed step does that fraction more work):

    plain0  slow1  plain2  slow3  plain4 ...

A/A comparison k is plain(2k) vs plain(2k+2); planted comparison k is plain(2k) vs slow(2k+1).
Neighbours in time are compared, as a CI job compares against a baseline taken recently; a
gate that only passes on a quiet machine would fail here, since the CPU is shared.
Arguments after ``--`` go to ``python -m bench_lib run`` (default: the ci profile).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_lib.compare import gate as cmp
from bench_lib.measure.environment import INJECT_SLOWDOWN_ENV
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
    return cmp.compare_runs(cmp.load_run(base), cmp.load_run(cand), threshold)


def describe(kind: str, k: int, results: list[cmp.CaseResult]) -> str:
    """One line: the pair, the gate's answer, and each case's change and verdict."""
    parts = []
    for r in results:
        change = r.changes.get(r.by)
        shown = f"{change.value:+.1%}" if change else "-"
        parts.append(f"{r.strategy} {shown} {r.verdict}")
    word = "FAIL" if cmp.exit_code(results) else "pass"
    return f"{kind} #{k + 1}: {word}  (" + "; ".join(parts) + ")"


def main(argv: list[str]) -> int:
    split = argv.index("--") if "--" in argv else len(argv)
    own, run_args = argv[:split], argv[split + 1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=5, help="A/A and planted comparisons each")
    p.add_argument("--slowdown", type=float, default=0.15, help="planted slowdown (fraction)")
    p.add_argument("--threshold", type=float, default=cmp.DEFAULT_THRESHOLD_PCT,
                   help="the gate's threshold in percent")
    p.add_argument("--out", type=Path, help="where the run folders go (default: a temp dir)")
    args = p.parse_args(own)
    run_args = run_args or ["--profile", "ci"]
    out = args.out or Path(tempfile.mkdtemp(prefix="regression-gate-"))
    print(f"run folders under {out}; run args: {' '.join(run_args)}", flush=True)

    plain = [run_sweep(out / "plain0", run_args, 0.0)]
    aa_fail = planted_caught = 0
    for k in range(args.pairs):
        slow = run_sweep(out / f"slow{2 * k + 1}", run_args, args.slowdown)
        plain.append(run_sweep(out / f"plain{2 * k + 2}", run_args, 0.0))
        aa = judge(plain[k], plain[k + 1], args.threshold)
        planted = judge(plain[k], slow, args.threshold)
        aa_fail += bool(cmp.exit_code(aa))
        planted_caught += bool(cmp.exit_code(planted))
        print(describe("A/A", k, aa), flush=True)
        print(describe(f"planted {args.slowdown:.0%}", k, planted), flush=True)
    print(f"A/A: {args.pairs - aa_fail}/{args.pairs} passed (no false regression); planted "
          f"{args.slowdown:.0%} slowdown: {planted_caught}/{args.pairs} caught; threshold "
          f"{args.threshold:g}%")
    return 0 if aa_fail == 0 and planted_caught == args.pairs else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
