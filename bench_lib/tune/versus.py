"""tune against the exhaustive sweep of the same workload, in one window (issue #17 part 3's
goal: a configuration within 5% of the sweep's best in at most a third of its time).

Each round runs ``python -m bench_lib tune`` and ``python -m bench_lib run`` with the same
workload flags, one after the other, the order alternating by round (tune first in even
rounds) so that drift over the window weighs on both alike. Each command is timed whole,
from process start to exit, as a user would wait for it (the sweep's includes its idle
power and FLOP peak probes, which tune does not need). The pick is judged on the SWEEP's
numbers: tune's winner's median step time in the sweep's cases.csv against the sweep's best
there, so tune's own (shorter, fewer) measurements grade nothing.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

WITHIN_PCT = 5.0
"""The pick's sweep median may exceed the sweep's best by at most this (issue #17)."""
TIME_RATIO = 1 / 3
"""tune's wall time over the sweep's, at most (issue #17)."""


@dataclass(frozen=True)
class Round:
    """One round: both commands' wall times and the pick judged on the sweep's numbers."""

    tune_first: bool
    tune_s: float
    sweep_s: float
    sweep_best: str
    """The sweep's fastest ok case (lowest step_time_s_median)."""
    sweep_best_s: float
    pick: str
    """tune's winner."""
    pick_in_sweep_s: float | None
    """The winner's median step time in the sweep (None: the sweep has no ok row of it)."""
    verdict: str
    """tune's verdict (separated, tie...)."""

    @property
    def ratio(self) -> float:
        return self.tune_s / self.sweep_s

    @property
    def pick_over_best_pct(self) -> float | None:
        if self.pick_in_sweep_s is None:
            return None
        return 100 * (self.pick_in_sweep_s / self.sweep_best_s - 1)

    @property
    def goals_met(self) -> bool:
        over = self.pick_over_best_pct
        return over is not None and over <= WITHIN_PCT and self.ratio <= TIME_RATIO


def _timed(cmd: Sequence[str]) -> tuple[float, Path]:
    """Run a bench_lib command; its wall time and the run folder it printed last."""
    start = time.monotonic()
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    seconds = time.monotonic() - start
    lines = proc.stdout.strip().splitlines()
    if proc.returncode not in (0, 1) or not lines:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    return seconds, Path(lines[-1])


def case_ids(run_dir: Path) -> set[str]:
    """Every case a run folder's cases.csv lists, whatever its status."""
    with (run_dir / "cases.csv").open(newline="") as f:
        return {r["case_id"] for r in csv.DictReader(f)}


def sweep_medians(run_dir: Path, among: set[str] | None = None) -> dict[str, float]:
    """Each ok case's median step time in a run folder's cases.csv (of the cases ``among``
    only, where given)."""
    with (run_dir / "cases.csv").open(newline="") as f:
        return {r["case_id"]: float(r["step_time_s_median"]) for r in csv.DictReader(f)
                if r["status"] == "ok" and r["step_time_s_median"]
                and (among is None or r["case_id"] in among)}


def judge(tune_dir: Path, sweep_dir: Path, tune_s: float, sweep_s: float,
          tune_first: bool) -> Round:
    """A round from its two run folders and wall times. The sweep's best is among the
    configurations tune chose from (its cases.csv, skipped ones included): the sweep also
    runs single's batch curve and weak scaling, whose step times are of other batches."""
    summary = json.loads((tune_dir / "tune.json").read_text())
    medians = sweep_medians(sweep_dir, case_ids(tune_dir))
    best = min(medians, key=medians.__getitem__)
    pick = summary["winner"] or ""
    return Round(tune_first, tune_s, sweep_s, best, medians[best], pick, medians.get(pick),
                 summary["verdict"])


def one_round(index: int, out: Path, flags: Sequence[str]) -> Round:
    """Round ``index``: tune and the sweep of ``flags``, tune first in even rounds."""
    py = [sys.executable, "-m", "bench_lib"]
    tune = [*py, "tune", "--quiet", "--out", str(out / f"round{index}" / "tune"), *flags]
    sweep = [*py, "run", "--quiet", "--out", str(out / f"round{index}" / "sweep"), *flags]
    tune_first = index % 2 == 0
    if tune_first:
        (tune_s, tune_dir), (sweep_s, sweep_dir) = _timed(tune), _timed(sweep)
    else:
        (sweep_s, sweep_dir), (tune_s, tune_dir) = _timed(sweep), _timed(tune)
    return judge(tune_dir, sweep_dir, tune_s, sweep_s, tune_first)


def round_line(i: int, r: Round) -> str:
    over = r.pick_over_best_pct
    pick = f"{r.pick_in_sweep_s:.4f} s ({over:+.1f}%)" if over is not None else "not in sweep"
    return (f"round {i} ({'tune' if r.tune_first else 'sweep'} first): tune {r.tune_s:.0f} s, "
            f"sweep {r.sweep_s:.0f} s, ratio {r.ratio:.2f}; sweep best {r.sweep_best} "
            f"{r.sweep_best_s:.4f} s; tune picked {r.pick} ({r.verdict}), in the sweep "
            f"{pick}; goals {'met' if r.goals_met else 'NOT met'}")


def summary_lines(rounds: Sequence[Round]) -> list[str]:
    """The rounds and the goals over all of them."""
    lines = [round_line(i, r) for i, r in enumerate(rounds)]
    met = sum(r.goals_met for r in rounds)
    ratios = ", ".join(f"{r.ratio:.2f}" for r in rounds)
    lines.append(f"goals (pick within {WITHIN_PCT:g}% of the sweep's best on the sweep's "
                 f"numbers, tune <= {TIME_RATIO:.2f} of the sweep's time) met in {met} of "
                 f"{len(rounds)} rounds; time ratios {ratios}")
    return lines
