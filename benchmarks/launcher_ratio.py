"""Does starting the ranks through torchrun change what is measured? (issue #15: within 3%)

    python benchmarks/launcher_ratio.py [--pairs 3] [--quick] [-- RUN ARGS...]

Runs single-node ddp and gpipe sweeps with the local launcher and with ``--launcher
torchrun``, interleaved in pairs whose order alternates (local then torchrun, then torchrun
then local...), so that drift over the session weighs on both launchers alike. Per pair and
strategy the ratio is torchrun's median step time over the local launcher's; the ratios are
summarised as a geometric mean with its t interval across pairs
(``analysis.stats.paired_ratio_interval``) and their min-max spread. A strategy's verdict:
``within 3%`` when the whole interval lies inside [0.97, 1.03], ``outside`` when it lies
wholly outside, else ``undecided`` (more pairs, a quieter machine).

Arguments after ``--`` go to ``python -m bench_lib run`` (default: the smoke profile's
workload, one launch per case, since the pairs are the replication here). ``--quick`` is a
check that the script works (a tiny model, one pair), not a measurement.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_lib.analysis.stats import paired_ratio_interval
from bench_lib.results.read import read_cases, run_dirs_in

STRATEGIES = ("ddp", "gpipe")
BAND = 0.03
DEFAULT_ARGS = ["--profile", "smoke", "--launches", "1"]
QUICK_ARGS = ["--profile", "smoke", "--models", "resnet-tiny", "--image-sizes", "32",
              "--batch-sizes", "4", "--split-sizes", "2", "--warmup-steps", "1",
              "--timed-steps", "2", "--launches", "1"]


def run_sweep(out: Path, launcher: str, run_args: list[str]) -> Path:
    """One real sweep of ``STRATEGIES`` with ``launcher`` into the fresh folder ``out``."""
    cmd = [sys.executable, "-m", "bench_lib", "run", "--quiet", "--out", str(out),
           "--strategies", ",".join(STRATEGIES), "--launcher", launcher, *run_args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    runs = run_dirs_in(out)
    if proc.returncode != 0 or len(runs) != 1:
        sys.exit(f"run failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    return runs[0]


def medians(run_dir: Path) -> dict[str, float]:
    """Each strategy's median step time in a run folder (its ok rows only)."""
    df = read_cases(run_dir)
    ok = df[df["status"] == "ok"]
    return {str(r["strategy"]): float(r["step_time_s_median"]) for _, r in ok.iterrows()}


def verdict(low: float, high: float) -> str:
    """Whether the ratio's interval lies within, outside or across the 3% band."""
    if math.isnan(low):
        return "undecided (one pair: no interval)"
    if 1 - BAND <= low and high <= 1 + BAND:
        return f"within {BAND:.0%}"
    if high < 1 - BAND or low > 1 + BAND:
        return f"outside {BAND:.0%}"
    return "undecided"


def summary(strategy: str, local: list[float], torchrun: list[float]) -> str:
    """One line per strategy: the ratio, its interval and spread, the verdict."""
    if not local or len(local) != len(torchrun):
        return f"{strategy}: not measured in every run (see the run folders)"
    ratio = paired_ratio_interval(torchrun, local)
    ratios = [t / s for t, s in zip(torchrun, local)]
    interval = ("" if math.isnan(ratio.low)
                else f" [{ratio.low:.3f}, {ratio.high:.3f}] ({ratio.method})")
    return (f"{strategy}: torchrun/local step time {ratio.point:.3f}{interval}, pairs "
            f"{min(ratios):.3f}-{max(ratios):.3f}: {verdict(ratio.low, ratio.high)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3, help="interleaved runs of each launcher")
    p.add_argument("--quick", action="store_true",
                   help="a tiny model and one pair: checks the script, measures nothing")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for the run folders (default: a temporary folder)")
    args, rest = p.parse_known_args()
    run_args = [a for a in rest if a != "--"] or (QUICK_ARGS if args.quick else DEFAULT_ARGS)
    pairs = 1 if args.quick else args.pairs
    out = args.out or Path(tempfile.mkdtemp(prefix="launcher-ratio-"))
    times: dict[str, dict[str, list[float]]] = {"local": {}, "torchrun": {}}
    for k in range(pairs):
        order = ("local", "torchrun") if k % 2 == 0 else ("torchrun", "local")
        got = {launcher: medians(run_sweep(out / f"pair{k}-{launcher}", launcher, run_args))
               for launcher in order}
        for strategy in STRATEGIES:
            if all(strategy in got[launcher] for launcher in order):
                for launcher in order:
                    times[launcher].setdefault(strategy, []).append(got[launcher][strategy])
        print(f"pair {k + 1}/{pairs} ({' then '.join(order)}): " + "; ".join(
            f"{s} {got['local'].get(s, math.nan):.4f} s vs {got['torchrun'].get(s, math.nan):.4f} s"
            for s in STRATEGIES), flush=True)
    for strategy in STRATEGIES:
        print(summary(strategy, times["local"].get(strategy, []),
                      times["torchrun"].get(strategy, [])))
    print(f"run folders: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
