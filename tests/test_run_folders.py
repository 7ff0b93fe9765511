"""Run folders say what they are (issue #27): their names end in the command, and for run,
tune and merge the profile (``<UTC time>_<host>_<git sha7>_run-smoke``); a ``latest-<command>``
link beside them points at each command's newest; ``make report`` reads the newest ``run``
folder through it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from bench_lib.results import store
from bench_lib.results.read import run_dirs_in
from bench_lib.results.store import link_latest, new_run_id, safe_name, start_run_dir
from tests.conftest import REPO

SHAPE = r"\d{8}T\d{6}Z_[A-Za-z0-9.-]+_[0-9a-f]{7}_"


@pytest.mark.parametrize(("command", "profile", "ending"), [
    ("run", "smoke", "_run-smoke"),
    ("tune", "default-cpu", "_tune-default-cpu"),
    ("parity", None, "_parity"),
    ("distance", None, "_distance"),
    ("merge", "ci", "_merge-ci"),
])
def test_a_run_folder_name_says_which_command_and_profile_made_it(command, profile, ending):
    name = new_run_id("abc1234def", command, profile)
    assert re.fullmatch(SHAPE + re.escape(ending.lstrip("_")), name), name
    assert "_abc1234_" in name
    assert new_run_id(None, command, profile).split("_")[2] == "nogit"


def test_a_profile_path_s_name_is_kept_file_system_safe():
    assert safe_name("my profile_v2/../x") == "my-profile-v2-..-x"
    assert new_run_id("abc1234", "run", "my_profile").endswith("_run-my-profile")
    assert safe_name("/..") == "x"
    assert len(safe_name("p" * 80)) == 40
    with pytest.raises(ValueError, match="unknown command 'gate'; valid: run, tune"):
        new_run_id("abc1234", "gate")


def _folder(root: Path, command: str, profile: str | None = None) -> Path:
    run_dir = start_run_dir(root, "abc1234", command, profile)
    (run_dir / "env.json").write_text("{}\n")
    return run_dir


def test_latest_links_are_relative_replaced_and_not_run_folders(tmp_path):
    root = tmp_path / "results"
    first = _folder(root, "run", "smoke")
    parity = _folder(root, "parity")
    assert os.readlink(root / "latest-run") == first.name  # relative: the tree can move
    assert os.readlink(root / "latest-parity") == parity.name
    second = _folder(root, "run", "smoke")  # the same second: a distinct folder
    assert second.name == f"{first.name}-2"
    assert os.readlink(root / "latest-run") == second.name
    assert (root / "latest-run").resolve() == second.resolve()
    # Each folder once, not again through its link; no temporary link left behind.
    assert run_dirs_in(root) == sorted([first, second, parity])
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []
    moved = shutil.move(root, tmp_path / "elsewhere")
    assert (Path(moved) / "latest-run" / "env.json").is_file()


def test_a_link_that_cannot_be_made_costs_a_warning_not_the_run(tmp_path, capsys):
    (tmp_path / "latest-run").mkdir()  # a folder of that name: not ours to replace
    run_dir = start_run_dir(tmp_path, "abc1234", "run", "smoke")
    assert run_dir.is_dir()
    assert f"warning: could not point {tmp_path / 'latest-run'} at {run_dir.name}" in (
        capsys.readouterr().err)


def test_a_link_is_replaced_atomically(tmp_path, monkeypatch):
    """Through a temporary link and os.replace: a reader never finds the link missing."""
    old, new = (_folder(tmp_path, "tune", "default-cpu") for _ in range(2))
    replaced: list[tuple[str, str]] = []
    real = os.replace

    def spy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        # The link stands, at its old folder, until the rename puts the new one in its place.
        replaced.append((os.readlink(dst), os.readlink(src), Path(dst).name))
        real(src, dst)

    monkeypatch.setattr(store.os, "replace", spy)
    link_latest(old, "tune")
    link_latest(new, "tune")
    assert replaced == [(new.name, old.name, "latest-tune"), (old.name, new.name, "latest-tune")]


def test_a_run_refused_by_its_usage_checks_creates_nothing(tmp_path, capsys):
    from bench_lib import commands, exit_codes

    code = commands.main(["run", "--profile", "smoke", "--rig", "cpu", "--strategies", "nope",
                          "--out", str(tmp_path / "out")])
    assert code == exit_codes.EXIT_USAGE
    assert not (tmp_path / "out").exists()


# ---- make report: the newest `run` folder, not the newest folder ---------------------------


def _make_report(tree: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``make report`` in ``tree`` with the repository's Makefile, its python an echo (and
    the venv taken as made): the recipe's choice of folders, run for real."""
    return subprocess.run(["make", "--no-print-directory", "-f", str(REPO / "Makefile"),
                           "-o", ".venv/.installed", "report", "PY=echo", *extra],
                          cwd=tree, capture_output=True, text=True, timeout=60)


@pytest.mark.integration
@pytest.mark.skipif(not shutil.which("make"), reason="needs make")
def test_make_report_reads_the_newest_run_folder_not_a_newer_parity_one(tmp_path):
    results = tmp_path / "results"
    none = _make_report(tmp_path)
    assert none.returncode == 2
    assert "error: no run folder: results/latest-run" in none.stderr
    older = _folder(results, "run", "smoke")
    newer = _folder(results, "run", "ci")
    _folder(results, "parity")  # newest of all, and sorted last: not a bench run
    (results / f"{newer.name}.node1").mkdir()  # a follower node's work folder
    chosen = _make_report(tmp_path)
    assert chosen.returncode == 0, chosen.stderr
    assert chosen.stdout.split() == ["-m", "bench_lib", "report", f"results/{newer.name}"]
    given = _make_report(tmp_path, f"RUNS=results/{older.name} results/{newer.name}")
    assert given.stdout.split()[3:] == [f"results/{older.name}", f"results/{newer.name}"]
    shutil.rmtree(newer)  # the link now points nowhere: said, not a traceback
    assert _make_report(tmp_path).returncode == 2


def test_the_baseline_store_is_no_run_folder_and_gets_no_link():
    baseline = REPO / "results" / "baseline"
    assert not [p for p in baseline.iterdir() if p.name.startswith("latest-")]
    for folder in (p for p in baseline.iterdir() if p.is_dir()):
        assert json.loads((folder / "env.json").read_text())  # stored by fingerprint
