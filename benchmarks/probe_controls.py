"""Which control of the machine's speed narrows a gate's intervals most? Kept gates re-judged.

    python benchmarks/probe_controls.py GATE_DIR [GATE_DIR ...]

GATE_DIR: a gate folder (``gate.json`` and its rounds' run folders), or a folder holding
them (``benchmarks/same_job_gate.py --keep DIR`` keeps one per gate). For every case one
process times (the speed probe's cases; ddp's ranks are left out), each way of turning a
launch's steps and their speed probes (steps.csv ``step_time_s``, ``probe_s``) into the
launch's figure is judged as the gate judges (``compare.paired.paired_change``: per round,
head over base, the t interval of the rounds' log ratios). First the gate's own judgement
(``compare.paired``) with the probe to the power it fits (``probe_coefficient``), to the power
1 (the probe whole) and 0 (seconds);
then other ways (``FIGURES``): the rule before the power (the median of each step over the
probe timed before it), other uses of the probes, and seconds. Prints each interval and,
per way, the median half-width over every interval. Last, ``ddp`` (two ranks, which the gate
judges in seconds): its steps over its ranks' probes (their geometric mean per step) to the
power the gate fits on its one-process cases, and whole, beside seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from bench_lib.compare import paired, runs
from bench_lib.compare import verdicts as cmp
from bench_lib.compare.runs import Run


def _bracketed(s: np.ndarray, p: np.ndarray) -> float:
    after = np.append(p[1:], p[-1])  # the next step's probe, timed just after this step
    return float(np.median(s / np.sqrt(p * after)))


def _rolling(s: np.ndarray, p: np.ndarray) -> float:
    smooth = pd.Series(np.log(p)).rolling(3, center=True, min_periods=1).mean().to_numpy()
    return float(np.median(s / np.exp(smooth)))


FIGURES: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
    "step / probe before it (the rule before the power)": lambda s, p: float(np.median(s / p)),
    "step / mean of probes before and after": _bracketed,
    "step / 3-probe rolling mean": _rolling,
    "median step / median probe": lambda s, p: float(np.median(s) / np.median(p)),
    "median step / fastest probe": lambda s, p: float(np.median(s) / np.min(p)),
    "mean of log(step / probe)": lambda s, p: math.exp(float(np.mean(np.log(s / p)))),
    "25th percentile of step / probe": lambda s, p: float(np.quantile(s / p, 0.25)),
    "seconds: median step": lambda s, p: float(np.median(s)),
    "seconds: fastest step": lambda s, p: float(np.min(s)),
    "seconds: 25th percentile": lambda s, p: float(np.quantile(s, 0.25)),
}


def gate_folders(paths: list[Path]) -> list[Path]:
    """Every folder holding a gate.json at or under ``paths``."""
    return sorted({g.parent for p in paths for g in
                   ([p / "gate.json"] if (p / "gate.json").is_file() else p.rglob("gate.json"))})


def half_width(change: cmp.Change) -> float:
    return (change.ci_high - change.ci_low) / 2


def gate_rule(gate: Path, base: Run, head: Run, widths: dict[str, list[float]]) -> None:
    """The gate's own judgement of its one-process cases with the fitted power, the probe
    whole and seconds: one line, and each half-width added to ``widths``."""
    fitted = paired.probe_coefficient(base, head)
    parts = []
    for label, power in ((f"b = {fitted:.2f}", fitted), ("whole", 1.0), ("seconds", 0.0)):
        found = []
        for cid in sorted(set(base.probes) & set(head.probes)):
            ch = paired.paired_changes(base, head, cid, power)["step_time"]
            widths.setdefault(label.split(" = ")[0], []).append(half_width(ch))
            found.append(f"{cid.split('_')[0]} {100 * ch.value:+.1f} +- "
                         f"{100 * half_width(ch):.1f}%")
        parts.append(f"{label}: {', '.join(found)}")
    print(f"{gate.name}: " + " | ".join(parts))


def other_rules(gate: Path, base: Run, head: Run, widths: dict[str, list[float]]) -> None:
    """Each of ``FIGURES`` for the gate's one-process cases, judged by the gate's own
    interval (``compare.paired.paired_change``): a line per case, each half-width added to
    ``widths``."""
    for cid in sorted(set(base.probes) & set(head.probes)):
        rounds = [r for r in base.launches[cid] if r in head.launches[cid]]
        parts = []
        for how, figure in FIGURES.items():
            ch = paired.paired_change(
                "step_time", [figure(head.launches[cid][r], head.probes[cid][r]) for r in rounds],
                [figure(base.launches[cid][r], base.probes[cid][r]) for r in rounds])
            widths[how].append(half_width(ch))
            parts.append(f"{100 * ch.value:+.1f} +- {100 * half_width(ch):.1f}%")
        print(f"{gate.name} {cid.split('_')[0]}: " + " | ".join(parts))


def ddp_rule(gate: Path, widths: dict[str, list[float]]) -> None:
    """``ddp`` judged in seconds, over its ranks' probes to the power the gate fits on its
    one-process cases, and over them whole: one line, each half-width added to ``widths``."""
    runs.ONE_PROCESS_PROBES = False  # read every case's probes, ddp's ranks' too
    try:
        base, head = paired.gate_sides(gate)
    finally:
        runs.ONE_PROCESS_PROBES = True
    ddp = [c for c in base.probes if c.startswith("ddp_") and c in head.probes]
    if not ddp:
        return

    def one_process(run: Run) -> Run:
        return dataclasses.replace(run, probes={c: p for c, p in run.probes.items()
                                                if not c.startswith("ddp_")})

    fitted = paired.probe_coefficient(one_process(base), one_process(head))
    parts = []
    for label, power in (("seconds", 0.0), (f"b = {fitted:.2f}", fitted), ("whole", 1.0)):
        ch = paired.paired_changes(base, head, ddp[0], power)["step_time"]
        widths.setdefault(label.split(" = ")[0], []).append(half_width(ch))
        parts.append(f"{label}: {100 * ch.value:+.1f} +- {100 * half_width(ch):.1f}%")
    print(f"{gate.name} ddp: " + " | ".join(parts))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gates", nargs="+", type=Path)
    args = parser.parse_args()
    gates = gate_folders(args.gates)
    if not gates:
        print("error: no gate.json under " + ", ".join(map(str, args.gates)), file=sys.stderr)
        return 2
    judged = {gate: paired.gate_sides(gate) for gate in gates}
    rule: dict[str, list[float]] = {}
    for gate, (base, head) in judged.items():
        gate_rule(gate, base, head, rule)
    print(f"the gate's judgement, median half-width over {len(rule.get('whole', []))} "
          "intervals:")
    for label, found in rule.items():
        name = "the fitted power b" if label == "b" else label
        print(f"  {name}: {100 * statistics.median(found):.1f}%")
    widths: dict[str, list[float]] = {how: [] for how in FIGURES}
    for gate, (base, head) in judged.items():
        other_rules(gate, base, head, widths)
    print(f"other rules, median half-width over {len(widths[next(iter(FIGURES))])} intervals "
          f"({len(gates)} gates):")
    for how, found in widths.items():
        print(f"  {how}: {100 * statistics.median(found):.1f}%")
    ddp: dict[str, list[float]] = {}
    for gate in gates:
        ddp_rule(gate, ddp)
    for label, found in ddp.items():
        print(f"  ddp, {label}: median half-width {100 * statistics.median(found):.1f}% over "
              f"{len(found)} gates")
    return 0


if __name__ == "__main__":
    sys.exit(main())
