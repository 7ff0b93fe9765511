"""The gate's two sides: which commit each measures, the environment it runs in, the
checks that refuse one before anything is timed, and one sweep of a side, each a
``python -m bench_lib run`` of its own worktree in its own process.

Both sides run under this same Python with ``PYTHONPATH`` at their worktree: torch and
every other package are the same on both, only the code differs (and ``--head-env``, set on
the head's side only). The test hooks are removed from both sides' environment otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_lib.fault_hooks import TEST_HOOK_VARIABLES
from bench_lib.gate.plan import GateError
from bench_lib.gate.worktrees import add_worktree, resolve_commit, working_tree_commit
from bench_lib.results.read import run_dirs_in
from bench_lib.results.schema import SCHEMA_VERSION

SIDES = ("base", "head")
PROBE = ("import bench_lib, bench_lib.results.schema as s; "
         "print(bench_lib.__file__); print(s.SCHEMA_VERSION)")
TAIL_LINES = 15

Progress = Callable[[str], None]
"""Where the gate says how far it got: a line at a time."""


def say_on_stderr(line: str) -> None:
    """The gate's progress line, on stderr (stdout holds its verdict)."""
    print(line, file=sys.stderr, flush=True)


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


def prepare(sides: Mapping[str, Side], repo: Path, work: Path, *, profile: str,
            run_args: Sequence[str], python: str,
            say: Progress = say_on_stderr) -> dict[str, dict[str, str]]:
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
