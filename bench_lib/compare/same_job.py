"""``gate``: base and head measured in the same job on this machine, judged round by round.

``compare`` judges a run against a stored baseline, which must come from the same hardware:
on a runner that changes CPU kind from one job to the next it has nothing to compare with,
and between jobs the spread is many times that within one. ``gate`` measures both sides
here and now instead:

* **Sides.** The base is a commit (``--base REF``); the head another (``--head REF``) or, by
  default, the working tree as it is when the gate starts: a commit object is made of it
  (tracked changes and the untracked files git does not ignore, through a temporary index:
  the branch, index and stash are left alone), so edits made while the gate runs are not
  measured. Each side is checked out into its own git worktree in a temporary folder and
  run by this same Python with ``PYTHONPATH`` at that worktree: torch and every other
  package are the same on both sides, only the code differs (and ``--head-env``, which sets
  environment variables on the head's side only: with the base equal to the head it compares
  settings, an allocator or thread variable, and it is how the error-rate demonstration
  plants a slowdown through the test-only ``PARABENCH_INJECT_SLOWDOWN``). The test hooks are
  removed from both sides' environment otherwise.
* **Refusals** (exit 2, before anything is measured): a REF that names no commit; a folder
  that is no git checkout; a working tree with unmerged files (a merge or rebase half done:
  no one version of it to measure); a side whose ``bench_lib`` cannot be imported from its
  own worktree, whose results schema is not this gate's (it could not read what that side
  writes), or whose ``run`` refuses the sweep (a dry run of it on each side first); a
  malformed ``--head-env``; run flags the gate sets itself.
* **Rounds.** ``--rounds`` R (default 5). In each round each side runs the sweep once
  (``run --launches 1``: every case launched once, in fresh processes; 2 warm-up and 6
  timed steps unless the run flags say otherwise, ``DEFAULT_STEPS``), base then head in
  even rounds and head then base in odd ones (B H | H B | B H | ...: ABBA), so that a
  linear drift, and a co-runner that lasts about a round, hit both sides alike.
* **The verdict.** Per case and round r, head_r / base_r of the two launch medians (a
  launch's median over its timed steps, a step's time its slowest rank's); the change is
  their geometric mean over the rounds less 1 (+ is slower), its interval the t interval
  over rounds (``paired_ratio_interval``: R - 1 degrees of freedom). What a round shares,
  the machine's state, cancels in each ratio; what remains is launch-to-launch noise. The
  rule is ``compare``'s: a regression only beyond ``--threshold-pct`` AND with the interval
  wholly above 0 (improvement likewise), the exit codes 0, 1 (a regression, or a case
  that ran in the base and failed in the head) and 2. Every case is judged on its step
  time (``--metric step_time``); in the same job, pairing does what the ``speedup``
  metric does for runs made apart. ``--metric speedup`` (or ``auto``: speedup for all
  but ``single``) judges each case on its time over its round's ``single``, paired the same.
* **Threshold.** 5% by default (``compare``'s is 10%). On a 2-core AMD EPYC VM a round's
  paired ratio spread 2.5-10% (sd of its log, a median 4.5%, in 6 gates of 4 rounds): the
  machine's speed moves that much from one 35-s run to the next, every case of a run alike
  (CPU time moves with it: it is not stolen time). That, not a launch's steps, sets the
  interval; ``benchmarks/same_job_gate.py`` measures the false-alarm and detection rates.
* **Output.** ``--out`` (default ``results/gates``) receives a gate folder: each round's
  run folders (``base/round-1/<run>``, ...), ``gate.json`` (sides, order, per-case
  verdicts, durations) and ``gate.md`` (the pull-request comment); ``--markdown`` and
  ``--json`` (github-action-benchmark's ``customBiggerIsBetter``) as in ``compare``. A
  gate that fails or is interrupted removes its folder; the worktrees always go.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_lib.analysis.stats import paired_ratio_interval
from bench_lib.compare import gate as cmp
from bench_lib.compare import output
from bench_lib.results.read import number, run_dirs_in
from bench_lib.results.schema import CALIBRATION_FILE, SCHEMA_VERSION
from bench_lib.test_hooks import TEST_HOOK_VARIABLES

DEFAULT_ROUNDS = 5
DEFAULT_STEPS = ("--warmup-steps", "2", "--timed-steps", "6")
"""Each launch's steps unless the run flags say otherwise: what spreads a gate's paired
ratios is the machine's speed from one run to the next (about 5% on 2 shared cores, every
case of a run alike), not a launch's own steps, so a round is worth more than 2 more steps."""
MIN_ROUNDS = 2
DEFAULT_THRESHOLD_PCT = 5.0
DEFAULT_PROFILE = "ci"
METRICS = ("step_time", "speedup", "auto")
METHOD_PAIRED = "paired t over rounds (base and head in the same job)"
SIDES = ("base", "head")
GATE_SETS = ("--launches", "--out", "--quiet", "--resume", "--shard", "--dry-run",
             "--report", "--compare-to", "--save-baseline", "--profile", "--calibration")
"""``run`` flags the gate sets itself (``--profile`` is the gate's own flag)."""
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
GIT_IDENTITY = {"GIT_AUTHOR_NAME": "parabench gate", "GIT_AUTHOR_EMAIL": "gate@parabench.invalid",
                "GIT_COMMITTER_NAME": "parabench gate",
                "GIT_COMMITTER_EMAIL": "gate@parabench.invalid"}
"""Who the working tree's commit object is by (it is never put on a branch)."""
PROBE = ("import bench_lib, bench_lib.results.schema as s; "
         "print(bench_lib.__file__); print(s.SCHEMA_VERSION)")
TAIL_LINES = 15
EXIT_INTERRUPTED = 130


class GateError(ValueError):
    """Input the gate refuses, or a side that could not be measured: exit 2."""


@dataclass(frozen=True)
class Side:
    """One side of the gate: what the user named, the commit measured, its extra variables."""

    name: str
    """``base`` or ``head``."""
    label: str
    """What was named: the REF as given, or ``working tree``."""
    sha: str
    note: str = ""
    """What else identifies it: ``HEAD a6ee5b2 + 3 changed files`` for a dirty working tree."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables set on this side only (``--head-env``)."""

    def describe(self) -> str:
        """``a6ee5b2c1d0e (HEAD)``, with the note and the variables where there are any."""
        extra = [self.label] + ([self.note] if self.note else []) + [
            f"{k}={v}" for k, v in self.env.items()]
        return f"{self.sha[:12]} ({'; '.join(extra)})"

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "sha": self.sha, "note": self.note, "env": dict(self.env)}


# ---- git --------------------------------------------------------------------------------


def git(repo: Path, *args: str, env: Mapping[str, str] | None = None) -> str:
    """``git args`` in ``repo``: its stdout, stripped; GateError with git's words on failure."""
    try:
        proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                              env=None if env is None else dict(env), timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        raise GateError(f"git {' '.join(args)}: {e}") from None
    if proc.returncode != 0:
        said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise GateError(f"git {' '.join(args)}: {said[-1] if said else f'exit {proc.returncode}'}")
    return proc.stdout.strip()


def repo_root(path: Path) -> Path:
    """The top of the git checkout holding ``path``."""
    try:
        return Path(git(path, "rev-parse", "--show-toplevel"))
    except GateError:
        raise GateError(f"{path} is not inside a git checkout: the gate checks out its base "
                        "and head from one (run it in a clone of parabench)") from None


def resolve_commit(repo: Path, ref: str, flag: str) -> str:
    """The full sha of the commit ``ref`` names."""
    try:
        sha = git(repo, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}")
    except GateError:
        sha = ""
    if not sha:
        raise GateError(f"{flag} {ref!r} names no commit in {repo}")
    return sha


def working_tree_commit(repo: Path) -> tuple[str, str]:
    """A commit of the working tree as it is now (tracked changes and untracked files git
    does not ignore), made through a temporary index, and a note of what it holds: ``""``
    for a clean tree (the commit is HEAD itself)."""
    if git(repo, "ls-files", "--unmerged"):
        raise GateError("the working tree has unmerged files (a merge or rebase in progress): "
                        "there is no one version of it to measure; resolve them, or name the "
                        "head with --head REF")
    head = git(repo, "rev-parse", "HEAD")
    changed = [line for line in git(repo, "status", "--porcelain", "--untracked-files=all")
               .splitlines() if line.strip()]
    if not changed:
        return head, ""
    with tempfile.TemporaryDirectory(prefix="parabench-gate-index-") as tmp:
        env = dict(os.environ, GIT_INDEX_FILE=str(Path(tmp) / "index"), **GIT_IDENTITY)
        git(repo, "read-tree", "HEAD", env=env)
        git(repo, "add", "--all", "--", ".", env=env)
        tree = git(repo, "write-tree", env=env)
        sha = git(repo, "commit-tree", tree, "-p", head, "-m",
                  "parabench gate: the working tree", env=env)
    return sha, f"HEAD {head[:12]} + {len(changed)} changed file{'s' * (len(changed) != 1)}"


def add_worktree(repo: Path, sha: str, path: Path) -> None:
    """Check ``sha`` out at ``path`` (detached), a worktree of ``repo``."""
    git(repo, "worktree", "add", "--detach", "--force", str(path), sha)


def remove_worktree(repo: Path, path: Path) -> None:
    """Remove the worktree at ``path`` and its record; never raises."""
    subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=repo,
                   capture_output=True, timeout=120, check=False)
    shutil.rmtree(path, ignore_errors=True)
    subprocess.run(["git", "worktree", "prune"], cwd=repo, capture_output=True, timeout=120,
                   check=False)


# ---- the sides' processes ---------------------------------------------------------------


def parse_env(items: Sequence[str]) -> dict[str, str]:
    """``NAME=VALUE`` strings as a mapping; GateError on a malformed one."""
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not ENV_NAME.fullmatch(name):
            raise GateError(f"--head-env {item!r}: expected NAME=VALUE, NAME a variable name")
        out[name] = value
    return out


def check_run_args(run_args: Sequence[str]) -> list[str]:
    """The flags after ``--``, for each side's ``run``; GateError on one the gate sets."""
    args = list(run_args)
    if args[:1] == ["--"]:
        args = args[1:]
    flags = {arg.split("=", 1)[0] for arg in args}
    if taken := sorted(flags & set(GATE_SETS)):
        raise GateError(f"{', '.join(taken)} is set by the gate itself; drop it from the run "
                        f"flags (the gate's own: --profile, --rounds, --out)")
    steps = [] if flags & {"--warmup-steps", "--timed-steps"} else list(DEFAULT_STEPS)
    return steps + args


def side_env(worktree: Path, extra: Mapping[str, str],
             base_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a side runs in: this one without the test hooks, ``PYTHONPATH``
    led by the side's worktree (its ``bench_lib`` before any installed one), then
    ``extra``."""
    env = {k: v for k, v in (os.environ if base_env is None else base_env).items()
           if k not in TEST_HOOK_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([str(worktree), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


def tail(text: str, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of ``text``, indented, for an error message."""
    return "\n".join("    " + line for line in text.strip().splitlines()[-lines:])


def check_side(side: Side, worktree: Path, env: Mapping[str, str], python: str,
               profile: str, run_args: Sequence[str]) -> None:
    """Refuse a side whose ``bench_lib`` cannot be imported from its worktree, whose
    results schema is not this gate's, or whose ``run`` refuses the sweep (a dry run)."""
    who = f"the {side.name} {side.describe()}"
    proc = subprocess.run([python, "-c", PROBE], cwd=worktree, env=dict(env),
                          capture_output=True, text=True, timeout=300)
    found = proc.stdout.split()
    if proc.returncode != 0 or len(found) < 2:
        raise GateError(f"{who}: its bench_lib cannot be imported:\n{tail(proc.stderr)}")
    where, schema = Path(found[-2]).resolve(), found[-1]
    if not where.is_relative_to(worktree.resolve()):
        raise GateError(f"{who}: bench_lib imports from {where}, not from its checkout "
                        f"{worktree} (a package installed otherwise than editable?)")
    if schema != str(SCHEMA_VERSION):
        raise GateError(f"{who} writes results schema {schema}; this gate reads schema "
                        f"{SCHEMA_VERSION} and could not judge what it writes")
    with tempfile.TemporaryDirectory(prefix="parabench-gate-dry-") as tmp:
        proc = subprocess.run([python, "-m", "bench_lib", "run", "--dry-run", "--profile",
                               profile, "--out", tmp, *run_args], cwd=worktree, env=dict(env),
                              capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise GateError(f"{who}: its run refuses the sweep (--profile {profile} "
                        f"{' '.join(run_args)}):\n{tail(proc.stderr or proc.stdout)}")


def order_text(order: Sequence[Sequence[str]]) -> str:
    """``B H | H B``: the sides' order, round by round."""
    return " | ".join(" ".join(side[0].upper() for side in sides) for sides in order)


def round_order(round_index: int) -> tuple[str, str]:
    """The sides in the order round ``round_index`` runs them: base first in even rounds,
    head first in odd ones (B H | H B | ...: ABBA over each pair of rounds)."""
    return SIDES if round_index % 2 == 0 else (SIDES[1], SIDES[0])


def run_side(worktree: Path, env: Mapping[str, str], python: str, out: Path, profile: str,
             run_args: Sequence[str]) -> Path:
    """One sweep of a side into the fresh folder ``out`` (each case launched once); its run
    folder. A run that ends with failed cases (exit 1) still counts: its rows say which."""
    cmd = [python, "-m", "bench_lib", "run", "--profile", profile, "--launches", "1",
           "--quiet", "--out", str(out), *run_args]
    proc = subprocess.run(cmd, cwd=worktree, env=dict(env), capture_output=True, text=True)
    runs = run_dirs_in(out) if out.exists() else []
    if proc.returncode not in (0, 1) or len(runs) != 1:
        raise GateError(f"{' '.join(cmd[1:])} (in {worktree}) ended with exit "
                        f"{proc.returncode}:\n{tail(proc.stderr)}")
    return runs[0]


# ---- the verdict ------------------------------------------------------------------------


SAID_PER_ROUND = ("contention", "throttled")
"""cases.csv columns that say why a case's times may be slow (other work on its CPU, GPU
clocks held back): a side's run says each with the rounds it happened in."""


def side_run(path: Path, rounds: Sequence[cmp.Run]) -> cmp.Run:
    """A side's rounds as one ``compare`` run: launch r is round r's launch. A case's row
    is its first round's, with the status of the first round it did not end ``ok`` in,
    every round's contention and throttling (``SAID_PER_ROUND``) said with the round, and
    the median over rounds of its step-time prediction error (where the side predicts); its
    launches are the rounds it ran ok."""
    cases: dict[str, dict[str, Any]] = {}
    launches: dict[str, cmp.Launches] = {}
    said: dict[tuple[str, str], list[str]] = {}  # (case, column) -> "round r: reason"
    errors: dict[str, list[float]] = {}
    for r, run in enumerate(rounds):
        for cid, row in run.cases.items():
            kept = cases.setdefault(cid, dict(row))
            if kept["status"] == "ok" and row["status"] != "ok":
                kept["status"] = row["status"]
            for column in SAID_PER_ROUND:
                reason = row.get(column)
                if isinstance(reason, str) and reason.strip():
                    said.setdefault((cid, column), []).append(f"round {r + 1}: {reason.strip()}")
            if (error := number(row.get("prediction_error_pct"))) is not None:
                errors.setdefault(cid, []).append(error)
        for cid, parts in run.launches.items():
            for samples in parts.values():
                launches.setdefault(cid, {})[r] = samples
    for (cid, column), reasons in said.items():
        cases[cid][column] = "; ".join(reasons)
    for cid, values in errors.items():
        cases[cid]["prediction_error_pct"] = statistics.median(values)
    return cmp.Run(path, rounds[0].env if rounds else {}, cases, launches)


def paired_change(metric: str, head: Sequence[float], base: Sequence[float]) -> cmp.Change:
    """The change head over base of figures paired by round, with the t interval over the
    rounds of their log ratios."""
    ratio = paired_ratio_interval(head, base)
    return cmp.Change(metric, ratio.point - 1, ratio.low - 1, ratio.high - 1, METHOD_PAIRED,
                      ratio.n, ratio.n)


def paired_changes(base: cmp.Run, head: cmp.Run, case_id: str) -> dict[str, cmp.Change]:
    """The case's paired step-time change and, where both sides ran its ``single`` in the
    same rounds, its paired change of time over single's (None-free: left out otherwise)."""
    hb, bb = head.launch_medians(case_id), base.launch_medians(case_id)
    rounds = [r for r in hb if r in bb]
    out = {"step_time": paired_change("step_time", [hb[r] for r in rounds],
                                      [bb[r] for r in rounds])}
    single = head.single_of(case_id)
    if single and single != case_id and single == base.single_of(case_id):
        hs, bs = head.launch_medians(single), base.launch_medians(single)
        both = [r for r in rounds if r in hs and r in bs]
        if both:
            out["speedup"] = paired_change("speedup", [hb[r] / hs[r] for r in both],
                                           [bb[r] / bs[r] for r in both])
    return out


def judge_cases(base: cmp.Run, head: cmp.Run, threshold_pct: float,
                metric: str) -> list[cmp.CaseResult]:
    """Per case of either side, in the head's order: the verdict by the paired rounds;
    ``broken`` where the base ran it ok and the head did not; ``n/a`` (with why) where the
    base did not, or the head's sweep lacks it."""
    results = []
    for cid in [*head.cases, *(c for c in base.cases if c not in head.cases)]:
        row = head.cases.get(cid) or base.cases[cid]
        strategy = str(row["strategy"])
        b_ok = cid in base.launches and base.cases[cid]["status"] == "ok"
        h_ok = cid in head.launches and head.cases[cid]["status"] == "ok"
        b_med = base.median_s(cid) if cid in base.launches else None
        h_med = head.median_s(cid) if cid in head.launches else None
        if b_ok and h_ok:
            ch = paired_changes(base, head, cid)
            verdict, by = cmp.judge(ch, metric, threshold_pct / 100)
            results.append(cmp.CaseResult(cid, strategy, b_med, h_med, ch, verdict, by))
        elif b_ok and cid in head.cases:
            results.append(cmp.CaseResult(cid, strategy, b_med, h_med, verdict="broken",
                                          by=f"head status {head.cases[cid]['status']}"))
        elif b_ok:
            results.append(cmp.CaseResult(cid, strategy, b_med, None, verdict="n/a",
                                          by="not in the head's sweep"))
        else:
            status = base.cases[cid]["status"] if cid in base.cases else "absent"
            results.append(cmp.CaseResult(cid, strategy, b_med, h_med, verdict="n/a",
                                          by=f"base status {status}"))
    return results


def gate_notes(results: list[cmp.CaseResult], base: cmp.Run, head: cmp.Run) -> list[str]:
    """What a reader needs beside the verdicts: busy, contended or throttled rounds, and a
    slowdown that hit every strategy alike."""
    out = []
    for name, run in (("base", base), ("head", head)):
        if busy := output.busy_cases(run):
            out.append(f"the {name}'s steps spread widely within a launch (IQR/median: "
                       f"{', '.join(busy)}): the machine was busy")
        if contended := output.contended_cases(run):
            out.append(f"the {name} was measured under contention: {'; '.join(contended)}")
        if throttled := output.throttled_cases(run):
            out.append(f"the {name} was measured with GPU clocks held back: "
                       f"{'; '.join(throttled)}")
    judged = [r for r in results if r.by in r.changes]
    if len(judged) > 1 and all(r.verdict == "regression" for r in judged):
        out.append("every case regressed: the head slows what all strategies share (the "
                   "model, the step, a setting), not one strategy alone")
    if grown := output.prediction_note(results, base, head):
        out.append(grown)
    return out


def method_line(results: list[cmp.CaseResult], rounds: int) -> str:
    """How the intervals were had, once."""
    ns = sorted({ch.n_base for r in results for ch in r.changes.values()})
    if not ns:
        return "no intervals: no case ran ok on both sides"
    return (f"{cmp.CONFIDENCE:.0%} intervals: t over {', '.join(map(str, ns))} of {rounds} "
            "rounds of head over base, paired by round")


def markdown_text(results: list[cmp.CaseResult], sides: Mapping[str, Side],
                  head: cmp.Run, summary: Mapping[str, Any], notes: list[str]) -> str:
    """Markdown for a pull-request comment: the verdict line, what was measured where, the
    table, the notes."""
    machine = head.env.get("fingerprint") or {}
    versions = head.env.get("versions") or {}
    where = ", ".join(str(x) for x in (machine.get("cpu_model"), machine.get("rig")) if x)
    lines = [f"### parabench same-job gate: {output.verdict_line(results)}", "",
             f"Base `{sides['base'].describe()}`, head `{sides['head'].describe()}`, both "
             f"measured in this job{f' on {where}' if where else ''}: profile "
             f"`{summary['profile']}`, {summary['rounds']} rounds in the order "
             f"{order_text(summary['order'])} "
             f"({summary['duration_s']:.0f} s). Threshold {summary['threshold_pct']:g}% and "
             f"a {cmp.CONFIDENCE:.0%} interval that excludes 0; changes are + when slower.",
             "", f"{method_line(results, summary['rounds'])}.", "",
             "| " + " | ".join(output.HEADER) + " |", "|" + "---|" * len(output.HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in output.rows(results)]
    said = [f"torch {versions['torch']}"] if versions.get("torch") else []
    said += [f"python {versions['python']}"] if versions.get("python") else []
    extra = notes + ([f"both sides ran in one environment: {', '.join(said)}"] if said else [])
    if extra:
        lines += [""] + [f"- {n}" for n in extra]
    return "\n".join(lines) + "\n"


def verdicts_json(results: list[cmp.CaseResult], base: cmp.Run, head: cmp.Run
                  ) -> list[dict[str, Any]]:
    """Per case: its verdict, the metric behind it, every change with its interval, and
    each side's step-time prediction error (the median over its rounds; None where that
    side made no prediction)."""
    def error(run: cmp.Run, cid: str) -> float | None:
        return number(run.cases.get(cid, {}).get("prediction_error_pct"))

    return [{"case_id": r.case_id, "strategy": r.strategy, "verdict": r.verdict, "by": r.by,
             "base_median_s": r.base_median_s, "head_median_s": r.cand_median_s,
             "changes": {m: {"value": c.value, "ci_low": c.ci_low, "ci_high": c.ci_high,
                             "rounds": c.n_base}
                         for m, c in r.changes.items()},
             "prediction_error_pct": {"base": error(base, r.case_id),
                                      "head": error(head, r.case_id)}} for r in results]


# ---- the command ------------------------------------------------------------------------


Progress = Callable[[str], None]


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def plan_sides(repo: Path, base_ref: str, head_ref: str | None,
               head_env: Mapping[str, str]) -> dict[str, Side]:
    """The two sides, resolved (GateError on a ref that is no commit, or an unmergeable
    working tree)."""
    base = Side("base", base_ref, resolve_commit(repo, base_ref, "--base"))
    if head_ref is None:
        sha, note = working_tree_commit(repo)
        head = Side("head", "working tree", sha, note, head_env)
    else:
        head = Side("head", head_ref, resolve_commit(repo, head_ref, "--head"), "", head_env)
    return {"base": base, "head": head}


def prepare(sides: Mapping[str, Side], repo: Path, work: Path, *, profile: str,
            run_args: Sequence[str], python: str,
            say: Progress = _say) -> dict[str, dict[str, str]]:
    """Check each side out under ``work`` and check it can be measured (``check_side``);
    each side's environment."""
    from concurrent.futures import ThreadPoolExecutor

    envs = {}
    for name, side in sides.items():
        add_worktree(repo, side.sha, work / name)
        envs[name] = side_env(work / name, side.env)
    say("gate: checking that both sides import, share this schema and accept the sweep ...")
    with ThreadPoolExecutor(len(sides)) as pool:  # both at once: nothing is timed yet
        checks = [pool.submit(check_side, side, work / name, envs[name], python, profile,
                              run_args) for name, side in sides.items()]
        for check in checks:
            check.result()  # the base's refusal first
    return envs


def measure(envs: Mapping[str, Mapping[str, str]], gate_dir: Path, work: Path, *,
            profile: str, rounds: int, run_args: Sequence[str], python: str,
            say: Progress = _say) -> tuple[dict[str, list[Path]], list[dict[str, Any]]]:
    """Run both sides (checked out under ``work``) in rounds (``round_order``); each
    side's run folders in round order and a record of every run (side, round, seconds)."""
    runs: dict[str, list[Path]] = {name: [] for name in envs}
    record: list[dict[str, Any]] = []
    started, total = time.monotonic(), 2 * rounds
    for r in range(rounds):
        for name in round_order(r):
            t0 = time.monotonic()
            reuse = reusable_calibration(runs[name][0]) if runs[name] else None
            args = [*run_args, *(["--calibration", str(reuse)] if reuse else [])]
            run = run_side(work / name, envs[name], python, gate_dir / name / f"round-{r + 1}",
                           profile, args)
            seconds = time.monotonic() - t0
            runs[name].append(run)
            record.append({"side": name, "round": r + 1, "seconds": round(seconds, 1),
                           "run": str(run.relative_to(gate_dir))})
            elapsed = time.monotonic() - started
            left = elapsed / len(record) * (total - len(record))
            say(f"  round {r + 1}/{rounds} {name}: {seconds:.0f} s"
                + (f" | ETA ~{left:.0f} s" if len(record) < total else ""))
    return runs, record


def reusable_calibration(run_dir: Path) -> Path | None:
    """The step-time calibration a side's first round measured, for its later rounds to
    reuse (``run --calibration``): seconds a round saved, and every round predicted from
    the same calibration, so that the rounds' errors differ by the measurement alone. None
    where that side does not predict (its profile's ``predict_time`` off) or predates
    ``--calibration`` (its calibration.json names no hardware)."""
    path = run_dir / CALIBRATION_FILE
    try:
        return path if json.loads(path.read_text()).get("hardware") else None
    except (OSError, ValueError, AttributeError):
        return None


def _remove_new(gate_dir: Path, out_existed: bool) -> None:
    """Remove a gate folder that did not finish, and ``--out`` if the gate made it."""
    shutil.rmtree(gate_dir, ignore_errors=True)
    if not out_existed and gate_dir.parent.exists() and not any(gate_dir.parent.iterdir()):
        gate_dir.parent.rmdir()


def run_gate(*, base_ref: str, head_ref: str | None = None, head_env: Sequence[str] = (),
             profile: str = DEFAULT_PROFILE, rounds: int = DEFAULT_ROUNDS,
             threshold_pct: float = DEFAULT_THRESHOLD_PCT, metric: str = "step_time",
             out: Path = Path("results/gates"), run_args: Sequence[str] = (),
             markdown: Path | None = None, json_path: Path | None = None,
             cwd: Path | None = None, python: str = sys.executable,
             say: Progress = _say) -> int:
    """The whole ``gate`` command: returns its exit code (module docstring)."""
    try:
        if rounds < MIN_ROUNDS:
            raise GateError(f"--rounds must be at least {MIN_ROUNDS} (an interval over rounds "
                            f"needs 2), got {rounds}")
        if not (threshold_pct >= 0 and math.isfinite(threshold_pct)):
            raise GateError(f"--threshold-pct must be a percentage >= 0, got {threshold_pct}")
        if metric not in METRICS:
            raise GateError(f"unknown metric {metric!r}; valid: {', '.join(METRICS)}")
        extra = parse_env(head_env)
        args = check_run_args(run_args)
        for flag, path in (("--markdown", markdown), ("--json", json_path)):
            if path is not None and not path.resolve().parent.is_dir():
                raise GateError(f"{flag} {path}: its folder {path.resolve().parent} does not "
                                "exist (checked now, not after the measurement)")
        here = (cwd or Path.cwd()).resolve()
        repo = repo_root(here)
        if Path(profile).suffix == ".toml":
            profile = str(here / profile)  # the sides run in their worktrees
        out = here / out
        sides = plan_sides(repo, base_ref, head_ref, extra)
    except GateError as e:
        print(f"error: {e}", file=sys.stderr)
        return cmp.EXIT_UNUSABLE
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    gate_dir = out / f"{stamp}_{sides['base'].sha[:7]}_{sides['head'].sha[:7]}"
    work = Path(tempfile.mkdtemp(prefix="parabench-gate-"))
    started = time.monotonic()
    order = [list(round_order(r)) for r in range(rounds)]
    say(f"gate: base {sides['base'].describe()}, head {sides['head'].describe()}; profile "
        f"{profile}, {rounds} rounds ({order_text(order)})")
    out_existed = out.exists()
    # A polite kill (SIGTERM: a CI job cancelled) cleans up as Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        envs = prepare(sides, repo, work, profile=profile, run_args=args, python=python,
                       say=say)
        gate_dir.mkdir(parents=True)
        runs, record = measure(envs, gate_dir, work, profile=profile, rounds=rounds,
                               run_args=args, python=python, say=say)
        base = side_run(gate_dir / "base", [cmp.load_run(p) for p in runs["base"]])
        head = side_run(gate_dir / "head", [cmp.load_run(p) for p in runs["head"]])
        results = judge_cases(base, head, threshold_pct, metric)
    except (GateError, cmp.CompareError, OSError) as e:
        _remove_new(gate_dir, out_existed)
        print(f"error: {e}", file=sys.stderr)
        return cmp.EXIT_UNUSABLE
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
    summary = {"profile": profile, "rounds": rounds, "order": order, "metric": metric,
               "threshold_pct": threshold_pct, "run_args": args,
               "duration_s": round(time.monotonic() - started, 1)}
    notes = gate_notes(results, base, head)
    (gate_dir / "gate.json").write_text(json.dumps(
        {**summary, "exit_code": code, "sides": {k: s.as_dict() for k, s in sides.items()},
         "runs": record, "cases": verdicts_json(results, base, head), "notes": notes},
        indent=2, default=str) + "\n")
    text = markdown_text(results, sides, head, summary, notes)
    (gate_dir / "gate.md").write_text(text)
    print(output.table(results))
    print(method_line(results, rounds))
    for n in notes:
        print(f"note: {n}")
    print(output.verdict_line(results) + f"  ({summary['duration_s']:.0f} s; {gate_dir})")
    if markdown:
        markdown.write_text(text)
    if json_path:
        json_path.write_text(json.dumps(output.benchmark_json(results, head, base), indent=2)
                             + "\n")
    return code


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``gate`` subcommand's arguments."""
    p.add_argument("--base", required=True, metavar="REF",
                   help="the commit to compare against (a branch, tag, sha, HEAD~1, ...)")
    p.add_argument("--head", metavar="REF",
                   help="the commit to judge (default: the working tree as it is now, "
                        "uncommitted changes and untracked files included)")
    p.add_argument("--head-env", action="append", default=[], metavar="NAME=VALUE",
                   help="set a variable on the head's side only (repeatable): with --base "
                        "equal to the head, an A/B of settings")
    p.add_argument("--profile", default=DEFAULT_PROFILE, metavar="NAME|PATH",
                   help=f"the sweep both sides run (default {DEFAULT_PROFILE})")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                   help=f"rounds of base and head, one launch per case each (default "
                        f"{DEFAULT_ROUNDS}; at least {MIN_ROUNDS})")
    p.add_argument("--threshold-pct", type=float, default=DEFAULT_THRESHOLD_PCT,
                   help=f"smallest change in percent that counts (default "
                        f"{DEFAULT_THRESHOLD_PCT:g})")
    p.add_argument("--metric", choices=METRICS, default="step_time",
                   help="what decides a verdict: step_time (default), speedup (time over "
                        "single's in the same round), or auto (speedup except for single)")
    p.add_argument("--out", type=Path, default=Path("results/gates"),
                   help="folder that receives the gate folder (default: results/gates)")
    p.add_argument("--markdown", type=Path, help="write Markdown for a pull-request comment here")
    p.add_argument("--json", type=Path,
                   help="write github-action-benchmark customBiggerIsBetter JSON here")
    p.add_argument("run_args", nargs=argparse.REMAINDER, metavar="-- RUN FLAGS",
                   help="flags for each side's run after --, e.g. -- --image-sizes 96")


def command(args: argparse.Namespace) -> int:
    """The ``gate`` subcommand."""
    return run_gate(base_ref=args.base, head_ref=args.head, head_env=args.head_env,
                    profile=args.profile, rounds=args.rounds, threshold_pct=args.threshold_pct,
                    metric=args.metric, out=args.out, run_args=args.run_args,
                    markdown=args.markdown, json_path=args.json)
