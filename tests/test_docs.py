"""Docs cannot drift: every command in a fenced ``sh`` block of README.md and docs/*.md that
calls the tool, ``make`` or a file of this repository is checked in a form that changes
nothing (the CLI's own parser, ``make -n``, the file's existence), and every relative link
points at a file that exists."""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest

from bench_lib import reference
from bench_lib.commands.parser import build_parser
from tests.conftest import REPO

DOCS = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
REPO_DIRS = ("benchmarks/", "bench_lib/", "docs/", "tests/", "notebooks/", "results/baseline")
PLACEHOLDER = re.compile(r"[<>*]|\$")


def fenced_sh(text: str) -> list[str]:
    """The commands of the ``sh`` blocks: continuation lines joined."""
    out, block, joined = [], False, ""
    for line in text.splitlines():
        if line.startswith("```"):
            block = line.strip() == "```sh"
            continue
        if not block:
            continue
        joined += line.rstrip()
        if joined.endswith("\\"):
            joined = joined[:-1] + " "
            continue
        if joined.strip():
            out.append(joined.strip())
        joined = ""
    return out


def commands() -> list[tuple[str, list[str]]]:
    """(where, tokens) of every command line, comments dropped; usage synopses (a token in
    ``[...]``) left out: they are patterns, not commands."""
    found = []
    for doc in DOCS:
        for line in fenced_sh(doc.read_text()):
            tokens = shlex.split(line, comments=True)
            if tokens and not any(t.startswith("[") for t in tokens):
                found.append((f"{doc.relative_to(REPO)}: {line}", tokens))
    return found


COMMANDS = commands()


def tool_args(tokens: list[str]) -> list[str] | None:
    """The arguments after ``python -m bench_lib`` (or ``parabench``), else None."""
    for i, token in enumerate(tokens):
        if token == "bench_lib" and i >= 1 and tokens[i - 1] == "-m":
            return tokens[i + 1:]
        if token == "parabench":
            return tokens[i + 1:]
    return None


def test_the_docs_hold_commands_to_check() -> None:
    tools = [c for c in COMMANDS if tool_args(c[1]) is not None]
    makes = [c for c in COMMANDS if c[1][0] == "make"]
    assert len(tools) >= 10 and len(makes) >= 5, (len(tools), len(makes))


@pytest.mark.parametrize("where,tokens", [c for c in COMMANDS if tool_args(c[1]) is not None],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_every_documented_command_parses(where: str, tokens: list[str],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    args = tool_args(tokens)
    assert args is not None
    try:
        build_parser().parse_args(args)
    except SystemExit as e:  # --help and --version exit 0 once printed
        if e.code != 0:
            pytest.fail(f"{where}\n  exits {e.code}: {capsys.readouterr().err.strip()}")


# What a dry run cannot stand in for: a folder of the reader's (placeholders), a stored
# baseline of the machine the docs were written on, a calibration of minutes.
NOT_DRY = ("--resume", "--compare-to", "--save-baseline", "--calibration", "--predict",
           "--shard", "--nnodes", "--launcher", "--help", "-h")


def dry_runs() -> list[tuple[str, list[str]]]:
    """The documented ``run`` commands a dry run can check whole (values, not only flags)."""
    found = []
    for where, tokens in COMMANDS:
        args = tool_args(tokens)
        if args and args[0] == "run" and not any(a.startswith(NOT_DRY) for a in args) \
                and not any(PLACEHOLDER.search(a) or a.isupper() for a in args):
            found.append((where, args if "--dry-run" in args else [*args, "--dry-run"]))
    return found


@pytest.mark.parametrize("where,args", dry_runs(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_documented_run_plans(where: str, args: list[str], tmp_path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Each documented sweep, planned as a dry run: a strategy, model or value the sweep
    refuses fails here, not in a reader's shell."""
    from bench_lib import commands

    code = commands.main([*args, "--out", str(tmp_path / "results")])
    assert code == 0, f"{where}\n  exits {code}: {capsys.readouterr().err.strip()}"
    assert not (tmp_path / "results").exists()


def test_the_docs_hold_sweeps_to_plan() -> None:
    assert len(dry_runs()) >= 5, dry_runs()


@pytest.mark.parametrize("where,tokens", COMMANDS, ids=lambda v: v if isinstance(v, str) else "")
def test_every_repository_file_a_command_names_exists(where: str, tokens: list[str]) -> None:
    for token in tokens:
        path = token.rstrip(")")
        if path.startswith(REPO_DIRS) and not PLACEHOLDER.search(path):
            assert (REPO / path).exists(), f"{where}: {path} does not exist"


@pytest.mark.integration
def test_every_documented_make_target_exists() -> None:
    targets = sorted({t[1] for _, t in COMMANDS if t[0] == "make" and len(t) > 1
                      and "=" not in t[1]})
    for target in targets:
        proc = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, f"make {target}: {proc.stderr.strip()}"


def test_every_relative_link_points_at_a_file() -> None:
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (doc.parent / target).exists(), f"{doc.relative_to(REPO)}: {target}"


@pytest.mark.parametrize("name", sorted(reference.PAGES))
def test_the_generated_reference_pages_are_current(name: str) -> None:
    page = REPO / "docs" / name
    assert page.exists() and page.read_text() == reference.PAGES[name](), (
        f"docs/{name} is stale: run `make docs` and commit it")
