"""The gate's two sides: which commit each measures, the environment it runs in, the
checks that refuse one before anything is timed, and one sweep of a side, each a
``python -m bench_lib run`` of its own worktree in its own process.

Both sides run under this same Python with ``PYTHONPATH`` at their worktree: torch and
every other package are the same on both, only the code differs (and ``--head-env``, set on
the head's side only). The test hooks are removed from both sides' environment otherwise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from bench_lib.fault_hooks import TEST_HOOK_VARIABLES
from bench_lib.gate.plan import GateError
from bench_lib.gate.worktrees import add_worktree, resolve_commit, working_tree_commit
from bench_lib.results.read import run_dirs_in
from bench_lib.results.schema import SCHEMA_VERSION

SIDES = ("base", "head")
PROBE = ("import bench_lib, bench_lib.results.schema as s; "
         "print(bench_lib.__file__); print(s.SCHEMA_VERSION); "
         "print(getattr(bench_lib, 'TAKES_TURNS', 0))")
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
               profile: str, run_args: Sequence[str]) -> bool:
    """Refuse a side whose ``bench_lib`` cannot be imported from its worktree, whose
    results schema is not this gate's, or whose ``run`` refuses the sweep (a dry run);
    whether it can step in turns with the other side (``bench_lib.TAKES_TURNS``)."""
    who = f"the {side.name} {side.describe()}"
    proc = subprocess.run([python, "-c", PROBE], cwd=worktree, env=dict(env),
                          capture_output=True, text=True, timeout=300)
    found = proc.stdout.split()
    if proc.returncode != 0 or len(found) < 3:
        raise GateError(f"{who}: its bench_lib cannot be imported:\n{tail(proc.stderr)}")
    where, schema, turns = Path(found[-3]).resolve(), found[-2], found[-1]
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
    return turns == "1"


def prepare(sides: Mapping[str, Side], repo: Path, work: Path, *, profile: str,
            run_args: Sequence[str], python: str,
            say: Progress = say_on_stderr) -> tuple[dict[str, dict[str, str]], bool]:
    """Check each side out under ``work`` and check it can be measured (``check_side``);
    each side's environment, and whether both can step in turns."""
    from concurrent.futures import ThreadPoolExecutor

    envs = {}
    for name, side in sides.items():
        add_worktree(repo, side.sha, work / name)
        envs[name] = side_env(work / name, side.env)
    say("gate: checking that both sides import, share this schema and accept the sweep ...")
    with ThreadPoolExecutor(len(sides)) as pool:  # both at once: nothing is timed yet
        checks = [pool.submit(check_side, side, work / name, envs[name], python, profile,
                              run_args) for name, side in sides.items()]
        turns = [check.result() for check in checks]  # the base's refusal first
    return envs, all(turns)


def run_side(worktree: Path, env: Mapping[str, str], python: str, out: Path, profile: str,
             run_args: Sequence[str]) -> Path:
    """One sweep of a side into the fresh folder ``out`` (each case launched once); its run
    folder. A run that ends with failed cases (exit 1) still counts: its rows say which."""
    return start_side(worktree, env, python, out, profile, run_args).finish()


@dataclass
class SideRun:
    """One side's sweep, started (``start_side``): ``finish`` waits for it."""

    cmd: list[str]
    worktree: Path
    out: Path
    proc: subprocess.Popen[bytes]
    stderr: IO[bytes]
    """A temporary file: two sides at once must not fill a pipe nobody reads."""

    def finish(self) -> Path:
        """Wait for the sweep; its run folder (GateError where it did not write one, or
        ended otherwise than 0 or 1). On an interruption the sweep is stopped."""
        try:
            code = self.proc.wait()
        except BaseException:
            self.stop()
            raise
        self.stderr.seek(0)
        err = self.stderr.read().decode(errors="replace")
        self.stderr.close()
        runs = run_dirs_in(self.out) if self.out.exists() else []
        if code not in (0, 1) or len(runs) != 1:
            raise GateError(f"{' '.join(self.cmd[1:])} (in {self.worktree}) ended with exit "
                            f"{code}:\n{tail(err)}")
        return runs[0]

    def stop(self) -> None:
        """Interrupt the sweep (as Ctrl-C would: its ranks go with it) and wait for it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_side(worktree: Path, env: Mapping[str, str], python: str, out: Path,
               profile: str, run_args: Sequence[str]) -> SideRun:
    """Start one sweep of a side into the fresh folder ``out`` (``run_side``), without
    waiting for it."""
    cmd = [python, "-m", "bench_lib", "run", "--profile", profile, "--launches", "1",
           "--quiet", "--out", str(out), *run_args]
    stderr = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, cwd=worktree, env=dict(env), stdout=subprocess.DEVNULL,
                            stderr=stderr)
    return SideRun(cmd, worktree, out, proc, stderr)
