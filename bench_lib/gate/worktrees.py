"""The gate's git: the checkout it runs in, the commits its sides name, a commit of the
working tree (made through a temporary index: the branch, index and stash are left alone),
and each side's worktree, checked out in a temporary folder and always removed."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from bench_lib.gate.plan import GateError

GIT_IDENTITY = {"GIT_AUTHOR_NAME": "parabench gate", "GIT_AUTHOR_EMAIL": "gate@parabench.invalid",
                "GIT_COMMITTER_NAME": "parabench gate",
                "GIT_COMMITTER_EMAIL": "gate@parabench.invalid"}
"""Who the working tree's commit object is by (it is never put on a branch)."""


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
