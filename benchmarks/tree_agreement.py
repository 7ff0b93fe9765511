"""Does a change to how launches run change what they measure? Two source trees, interleaved.

    git worktree add /tmp/base 721ca6d
    python benchmarks/tree_agreement.py --base /tmp/base [--pairs 2] [-- RUN ARGS...]

Runs the same sweep (default: single, ddp and 1f1b s4 of ResNet50 at 64 px, batch 16, 3
launches each, under this tree's default-cpu profile file) with the base tree's code and
with this tree's (each ``python -m bench_lib run`` from its own folder), in pairs whose order
alternates, so that drift weighs on both alike. Per pair and strategy it prints each run's
median step time with its 95% interval; then per strategy the ratio of this tree's median
to the base's, its t interval across pairs (``analysis.stats.paired_ratio_interval``), and
whether each tree's median lies inside the other's interval in every pair. Written for the
fork server and the reused warm-up (issue #24): they change a launch's start, not its steps.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_lib.analysis.stats import paired_ratio_interval
from bench_lib.results.read import read_cases, run_dirs_in

HERE = Path(__file__).resolve().parent.parent
# This tree's default-cpu profile file for both trees: the same measurement rule for each.
DEFAULT_ARGS = ["--profile", str(HERE / "bench_lib/sweep/profiles/default-cpu.toml"),
                "--strategies", "single,ddp,1f1b", "--image-sizes", "64", "--split-sizes", "4"]
Figure = tuple[float, float, float]
"""A case's median step time and its 95% interval, seconds."""


def run_tree(tree: Path, out: Path, run_args: list[str]) -> dict[str, Figure]:
    """One sweep with ``tree``'s code into the fresh folder ``out``: each strategy's figure."""
    cmd = [sys.executable, "-m", "bench_lib", "run", "--quiet", "--out", str(out), *run_args]
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    runs = run_dirs_in(out)
    if proc.returncode != 0 or len(runs) != 1:
        sys.exit(f"run failed ({proc.returncode}) in {tree}: {' '.join(cmd)}\n"
                 f"{proc.stderr[-2000:]}")
    ok = read_cases(runs[0]).query("status == 'ok'")
    return {str(r["strategy"]): (float(r["step_time_s_median"]),
                                 float(r["step_time_s_ci_low"]),
                                 float(r["step_time_s_ci_high"])) for _, r in ok.iterrows()}


def inside(a: Figure, b: Figure) -> bool:
    """Whether ``a``'s median lies in ``b``'s interval."""
    return b[1] <= a[0] <= b[2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, required=True, help="the other source tree")
    p.add_argument("--pairs", type=int, default=2, help="interleaved runs of each tree")
    p.add_argument("--out", type=Path, default=None, help="folder for the run folders")
    args, rest = p.parse_known_args()
    run_args = [a for a in rest if a != "--"] or DEFAULT_ARGS
    out = args.out or Path(tempfile.mkdtemp(prefix="tree-agreement-"))
    trees = {"base": args.base.resolve(), "this": HERE}
    figures: dict[str, list[dict[str, Figure]]] = {"base": [], "this": []}
    for k in range(args.pairs):
        order = ("base", "this") if k % 2 == 0 else ("this", "base")
        for name in order:
            figures[name].append(run_tree(trees[name], out / f"pair{k}-{name}", run_args))
        print(f"pair {k + 1}/{args.pairs} ({' then '.join(order)}):", flush=True)
        for s in sorted(figures["base"][-1]):
            b, t = figures["base"][-1][s], figures["this"][-1].get(s, (math.nan,) * 3)
            print(f"  {s:<6} base {b[0]:.4f} [{b[1]:.4f}, {b[2]:.4f}] s   this {t[0]:.4f} "
                  f"[{t[1]:.4f}, {t[2]:.4f}] s", flush=True)
    for s in sorted(figures["base"][0]):
        base = [f[s][0] for f in figures["base"]]
        this = [f[s][0] for f in figures["this"]]
        ratio = paired_ratio_interval(this, base)
        interval = "" if math.isnan(ratio.low) else f" [{ratio.low:.3f}, {ratio.high:.3f}]"
        agree = all(inside(t[s], b[s]) and inside(b[s], t[s])
                    for t, b in zip(figures["this"], figures["base"]))
        print(f"{s}: this/base median {ratio.point:.3f}{interval} over {args.pairs} pairs; "
              f"each median inside the other's interval in every pair: {agree}")
    print(f"run folders: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
