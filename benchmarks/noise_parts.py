"""What each case's launch-to-launch noise is made of on this machine, from A/A runs.

    python benchmarks/noise_parts.py RUN_DIR [RUN_DIR ...] [--rounds 5]
    python benchmarks/noise_parts.py --make 6 [--profile ci] [--out results/noise]

Reads run folders of the same sweep (or makes ``--make`` of them, one after another, with
``run --profile PROFILE``; the ``ci`` profile launches every case 3 times, interleaved) and
splits each case's launch medians' variance (``bench_lib.analysis.noise_parts``): ``run``
and ``slot``, the machine's speed common to every case of a run and of a round within it;
``launch``, the case's own launch; ``step``, its steps' noise carried into its median. Then
what a same-job gate's per-round ratio (head over base, one launch each, in two runs)
would spread by, and its interval's half-width over ``--rounds`` rounds, for each way of
cancelling the common part: none (today's gate), the ratio to ``single`` of the same round
(a speedup), a perfect control of the machine's speed (the case's own noise alone).
Spreads are standard deviations of log times, as %.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

from bench_lib.analysis import noise_parts
from bench_lib.analysis.stats import t_quantile
from bench_lib.compare.runs import load_run
from bench_lib.measure.environment import cpu_model


def make_runs(count: int, profile: str, out: Path) -> list[Path]:
    """``count`` runs of ``profile`` into ``out``, one after another."""
    made = []
    for i in range(count):
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "bench_lib", "run", "--profile", profile,
                               "--out", str(out), "--quiet"], capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"run {i + 1} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        made.append(Path(proc.stdout.strip().splitlines()[-1]))
        print(f"run {i + 1}/{count}: {time.monotonic() - t0:.0f} s {made[-1]}", file=sys.stderr)
    return made


def half_width_pct(variance: float, rounds: int) -> float:
    """The 95% t interval's half-width over ``rounds`` rounds of a log ratio of this
    variance, as % of the ratio."""
    return 100 * (math.exp(t_quantile(0.95, rounds - 1) * math.sqrt(variance / rounds)) - 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", type=Path, help="run folders of the same sweep")
    p.add_argument("--make", type=int, default=0, metavar="N", help="make N runs first")
    p.add_argument("--profile", default="ci")
    p.add_argument("--out", type=Path, default=Path("results/noise"))
    p.add_argument("--rounds", type=int, default=5, help="a gate's rounds (half-widths)")
    args = p.parse_args(argv)
    paths = [*args.runs, *(make_runs(args.make, args.profile, args.out) if args.make else [])]
    if len(paths) < 2:
        p.error("give at least 2 run folders (or --make 2 or more)")
    runs = [load_run(path) for path in paths]
    cases = [c for c in runs[0].launches if all(c in r.launches for r in runs)]
    parts = noise_parts.from_launches([r.launches for r in runs], cases)
    print(f"{len(runs)} runs x {parts.rounds} rounds, {cpu_model()}; spreads are SDs of log "
          "launch medians, %")
    print(f"common to every case: run {100 * math.sqrt(parts.run):.2f}%, "
          f"slot {100 * math.sqrt(parts.slot):.2f}%")
    print(f"{'case':44} {'total':>6} {'launch':>7} {'step':>6} {'common':>7}")
    for row in parts.rows():
        print(f"{row['case']:44} {row['total_pct']:6.2f} {row['launch_pct']:7.2f} "
              f"{row['step_pct']:6.2f} {row['common_share_pct']:6.1f}%")
    single = next((c for c in cases if c.startswith("single_")), None)
    print(f"\na gate's per-round ratio over {args.rounds} rounds, 95% half-width %: "
          "consecutive runs' first launches | as the parts say today | over single | "
          "perfect speed control")
    first = min(set.intersection(*(set(r.launches[c]) for r in runs for c in cases)))
    for c in cases:
        logs = [math.log(r.launch_medians(c)[first]) for r in runs]
        steps = [b - a for a, b in zip(logs, logs[1:], strict=False)]
        seen = sum(d * d for d in steps) / len(steps)  # mean square: A/A has no true change
        today = 2 * parts.total(c)
        control = 2 * parts.own[c]
        ratio = (2 * (parts.own[c] + parts.own[single])
                 if single and c != single else math.nan)
        print(f"{c:44} {half_width_pct(seen, args.rounds):6.2f} "
              f"{half_width_pct(today, args.rounds):6.2f} "
              f"{half_width_pct(ratio, args.rounds):6.2f} "
              f"{half_width_pct(control, args.rounds):6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
