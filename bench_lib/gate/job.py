"""The whole ``gate`` command, from a ``GatePlan`` to its exit code: refuse what cannot be
measured (exit 2, nothing written), check both sides out and check them, measure the rounds,
judge them (``bench_lib.compare.paired``), print the verdict and write the gate folder
(``gate.json``, ``gate.md``) and, where asked, the Markdown and JSON. A gate that fails or
is interrupted removes its folder; the worktrees always go."""

from __future__ import annotations

import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench_lib.compare import output, paired
from bench_lib.compare import verdicts as cmp
from bench_lib.compare.runs import CompareError, load_run
from bench_lib.exit_codes import EXIT_INTERRUPTED, EXIT_USAGE
from bench_lib.gate.plan import GateError, GatePlan, check
from bench_lib.gate.rounds import measure, sides_order
from bench_lib.gate.sides import SIDES, Progress, plan_sides, prepare, say_on_stderr
from bench_lib.gate.worktrees import remove_worktree, repo_root


def _remove_new(gate_dir: Path, out_existed: bool) -> None:
    """Remove a gate folder that did not finish, and ``--out`` if the gate made it."""
    shutil.rmtree(gate_dir, ignore_errors=True)
    if not out_existed and gate_dir.parent.exists() and not any(gate_dir.parent.iterdir()):
        gate_dir.parent.rmdir()


def run_gate(plan: GatePlan, *, cwd: Path | None = None, python: str = sys.executable,
             say: Progress = say_on_stderr) -> int:
    """The whole ``gate`` command, run from ``cwd`` (default: this process's): returns its
    exit code (``bench_lib.gate``'s docstring)."""
    try:
        head_env, args = check(plan)
        here = (cwd or Path.cwd()).resolve()
        repo = repo_root(here)
        profile = plan.profile
        if Path(profile).suffix == ".toml":
            profile = str(here / profile)  # the sides run in their worktrees
        out = here / plan.out
        sides = plan_sides(repo, plan.base_ref, plan.head_ref, head_env)
    except GateError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    rounds = plan.rounds
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    gate_dir = out / f"{stamp}_{sides['base'].sha[:7]}_{sides['head'].sha[:7]}"
    work = Path(tempfile.mkdtemp(prefix="parabench-gate-"))
    started = time.monotonic()
    say(f"gate: base {sides['base'].describe()}, head {sides['head'].describe()}; profile "
        f"{profile}, {rounds} rounds")
    out_existed = out.exists()
    # A polite kill (SIGTERM: a CI job cancelled) cleans up as Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        envs, both_take_turns = prepare(sides, repo, work, profile=profile, run_args=args,
                                        python=python, say=say)
        together = both_take_turns and not plan.apart
        order = [["base", "head"] if together else list(sides_order(r))
                 for r in range(rounds)]
        say(f"gate: {rounds} rounds, " + (
            "both sides at once, taking turns step by step" if together else
            f"one side after the other ({paired.order_text(order)})"
            + ("" if plan.apart else ": the base cannot take turns (older than them)")))
        gate_dir.mkdir(parents=True)
        runs, record = measure(envs, gate_dir, work, profile=profile, rounds=rounds,
                               run_args=args, python=python, say=say, together=together)
        base = paired.side_run(gate_dir / "base", [load_run(p) for p in runs["base"]])
        head = paired.side_run(gate_dir / "head", [load_run(p) for p in runs["head"]])
        power = paired.probe_coefficient(base, head)  # the verdicts' and the method line's
        results = paired.judge_cases(base, head, plan.threshold_pct, plan.metric, power)
        coefficient = (round(power, 3) if paired.same_probe(base, head)
                       and not paired.took_turns(base, head) else None)
    except (GateError, CompareError, OSError) as e:
        _remove_new(gate_dir, out_existed)
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        _remove_new(gate_dir, out_existed)
        print("interrupted: the gate kept nothing", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BaseException:
        _remove_new(gate_dir, out_existed)
        raise
    finally:
        for name in SIDES:
            remove_worktree(repo, work / name)
        shutil.rmtree(work, ignore_errors=True)
    code = cmp.exit_code(results)
    summary = {"profile": profile, "rounds": rounds, "order": order, "together": together,
               "metric": plan.metric,
               "probe_coefficient": coefficient,
               "threshold_pct": plan.threshold_pct, "run_args": args,
               "duration_s": round(time.monotonic() - started, 1)}
    notes = paired.gate_notes(results, base, head)
    (gate_dir / "gate.json").write_text(json.dumps(
        {**summary, "exit_code": code, "sides": {k: s.as_dict() for k, s in sides.items()},
         "runs": record, "cases": paired.verdicts_json(results, base, head), "notes": notes},
        indent=2, default=str) + "\n")
    text = paired.markdown_text(results, {k: s.describe() for k, s in sides.items()}, head,
                                summary, notes)
    (gate_dir / "gate.md").write_text(text)
    print(output.table(results))
    print(paired.method_line(results, rounds, coefficient))
    for n in notes:
        print(f"note: {n}")
    print(output.verdict_line(results) + f"  ({summary['duration_s']:.0f} s; {gate_dir})")
    if plan.markdown:
        plan.markdown.write_text(text)
    if plan.json_path:
        plan.json_path.write_text(json.dumps(output.benchmark_json(results, head, base),
                                             indent=2) + "\n")
    return code
