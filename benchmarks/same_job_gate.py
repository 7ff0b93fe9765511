"""The same-job gate's error rates on this machine: A/A gates pass, planted slowdowns fail.

    python benchmarks/same_job_gate.py [--aa 20] [--planted 10] [--slowdown 0.10]
                                       [--ref HEAD] [-- GATE ARGS...]

Runs real gates (``python -m bench_lib gate``), each base and head measured in the same job:

* A/A: ``--base REF --head REF``: the same code on both sides; a pass is right.
* planted: the same, with ``--head-env PARABENCH_INJECT_SLOWDOWN=S`` (every timed step of
  the head does S more work: the test-only hook, never set in a real measurement); a fail
  (exit 1) is right.

The kinds alternate (A/A, planted, A/A, ...) until each count is reached, so a machine that
changes over the hour hits both. Each gate's line gives its verdict, its duration and every
case's change with its interval; the last lines sum up: A/A passed, planted caught, the
durations (min, median, max) and the median half-width of the deciding intervals, beside
the same steps' by the rule before the gate's lever (``without_lever``). Arguments
after ``--`` go to every gate (e.g. ``-- --rounds 6`` or ``-- --profile smoke``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_lib.analysis.stats import MIN_LAUNCHES_FOR_CI, launch_interval
from bench_lib.compare import paired
from bench_lib.fault_hooks import INJECT_SLOWDOWN_ENV
from bench_lib.measure.environment import cpu_model


def one_gate(ref: str, slowdown: float, out: Path, gate_args: list[str]) -> tuple[int, dict, float]:
    """One real gate into ``out``: its exit code, its gate.json and its seconds."""
    cmd = [sys.executable, "-m", "bench_lib", "gate", "--base", ref, "--head", ref,
           "--out", str(out)]
    if slowdown:  # before the gate args: after their ``--`` it would go to each side's run
        cmd += ["--head-env", f"{INJECT_SLOWDOWN_ENV}={slowdown}"]
    cmd += gate_args
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    gates = sorted(out.iterdir()) if out.exists() else []
    if proc.returncode not in (0, 1) or len(gates) != 1:
        sys.exit(f"gate failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return proc.returncode, json.loads((gates[0] / "gate.json").read_text()), seconds


def describe(kind: str, k: int, code: int, record: dict, seconds: float) -> str:
    """``planted #3: FAIL (right) 301 s  single +10.4% [+6.1%, +14.9%] regression; ...``"""
    right = (code == 0) == (kind == "A/A")
    parts = []
    for case in record["cases"]:
        change = case["changes"].get(case["by"])
        shown = (f"{change['value']:+.1%} [{change['ci_low']:+.1%}, {change['ci_high']:+.1%}]"
                 if change else "-")
        parts.append(f"{case['strategy']} {shown} {case['verdict']}")
    return (f"{kind} #{k}: {'FAIL' if code else 'pass'} ({'right' if right else 'WRONG'}) "
            f"{seconds:.0f} s  " + "; ".join(parts))


def half_widths(record: dict) -> list[float]:
    """The deciding intervals' half-widths of one gate."""
    out = []
    for case in record["cases"]:
        change = case["changes"].get(case["by"])
        if change and change["ci_low"] == change["ci_low"]:  # not NaN
            out.append((change["ci_high"] - change["ci_low"]) / 2)
    return out


def without_lever(gate_dir: Path, record: dict) -> tuple[str, list[float]]:
    """The same gate's step-time half-widths by the rule before its lever, on the same
    steps: where the sides took turns, the t over rounds of each round's median pair (the
    rule before the pairs were pooled); apart, launch medians in seconds (the speed probes
    left out). What the lever bought; (the rule's name, the half-widths)."""
    base, head = paired.gate_sides(gate_dir)
    if paired.took_turns(base, head):
        widths = []
        for cid in head.cases:
            if cid in head.launches and cid in base.launches:
                rounds = paired.pair_figures(base, head, cid)
                if len(rounds) >= MIN_LAUNCHES_FOR_CI:
                    widths.append(launch_interval(list(rounds.values()), "rounds")
                                  .half_width_rel)
        return "by the t over rounds of their median pairs", widths
    base, head = (dataclasses.replace(side, probes={}) for side in (base, head))
    results = paired.judge_cases(base, head, record["threshold_pct"],
                                 record.get("metric", "auto"))
    return "in seconds, without the speed probe", [
        (c.ci_high - c.ci_low) / 2 for r in results
        if (c := r.changes.get(r.by)) is not None and c.ci_low == c.ci_low]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--aa", type=int, default=20, help="A/A gates (default 20)")
    p.add_argument("--planted", type=int, default=10, help="planted gates (default 10)")
    p.add_argument("--slowdown", type=float, default=0.10,
                   help="the planted slowdown, a fraction (default 0.10)")
    p.add_argument("--ref", default="HEAD", help="the commit both sides run (default HEAD)")
    p.add_argument("--keep", type=Path, metavar="DIR",
                   help="keep the gate folders here (default: a temporary folder)")
    p.add_argument("gate_args", nargs=argparse.REMAINDER)
    args = p.parse_args()
    gate_args = args.gate_args[1:] if args.gate_args[:1] == ["--"] else args.gate_args
    print(f"{args.aa} A/A and {args.planted} planted ({args.slowdown:+.0%}) gates of "
          f"{args.ref} on {cpu_model()}; gate args: {' '.join(gate_args) or '(defaults)'}",
          flush=True)
    plan = []
    aa, planted = list(range(1, args.aa + 1)), list(range(1, args.planted + 1))
    while aa or planted:
        if aa:
            plan.append(("A/A", aa.pop(0)))
        if planted:
            plan.append(("planted", planted.pop(0)))
    passed = caught = 0
    durations: list[float] = []
    widths: list[float] = []
    before: list[float] = []
    rule = ""
    with tempfile.TemporaryDirectory(prefix="parabench-gate-demo-") as tmp:
        for i, (kind, k) in enumerate(plan):
            out = (args.keep or Path(tmp)) / f"gate-{i}"
            code, record, seconds = one_gate(args.ref, args.slowdown if kind == "planted"
                                             else 0.0, out, gate_args)
            durations.append(seconds)
            widths += half_widths(record)
            rule, widths_before = without_lever(next(out.iterdir()), record)
            before += widths_before
            if kind == "A/A":
                passed += code == 0
            else:
                caught += code == 1
            print(describe(kind, k, code, record, seconds), flush=True)
    print(f"A/A passed {passed}/{args.aa}; planted {args.slowdown:+.0%} caught "
          f"{caught}/{args.planted}")
    print(f"gate duration {min(durations):.0f} / {statistics.median(durations):.0f} / "
          f"{max(durations):.0f} s (min / median / max over {len(durations)}); median "
          f"half-width of the deciding intervals "
          f"{statistics.median(widths):.1%} (over {len(widths)}); from the same steps "
          f"{rule}: {statistics.median(before):.1%}"
          if widths and before else "no intervals")
    return 0


if __name__ == "__main__":
    sys.exit(main())
