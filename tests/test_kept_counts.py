"""Counts kept on disk across processes (``prediction.kept_counts``): read back only for
the same arguments and the same code, counted again where damaged, never in the way."""

from __future__ import annotations

import os
import subprocess

import pytest

from bench_lib.prediction import fake_step, kept_counts
from bench_lib.prediction.fake_step import Program
from bench_lib.prediction.kept_counts import CACHE_ENV, KEEP_VERSIONS, kept
from bench_lib.workloads import Workload
from tests.conftest import PYTHON, REPO


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _counted(calls: list[tuple[int, ...]]):
    @kept("squares", list, lambda v: tuple(int(n) for n in v))
    def squares(*ns: int) -> tuple[int, ...]:
        calls.append(ns)
        return tuple(n * n for n in ns)
    return squares


def test_a_count_is_read_back_for_the_same_arguments_only(cache):
    calls: list[tuple[int, ...]] = []
    squares = _counted(calls)
    assert squares(2, 3) == (4, 9) and squares(2, 3) == (4, 9)
    assert squares(3, 2) == (9, 4)
    assert calls == [(2, 3), (3, 2)]
    (folder,) = (cache / "squares").iterdir()
    assert folder.name == kept_counts.code_version() and len(list(folder.iterdir())) == 2


def test_other_code_counts_again_and_the_oldest_code_folders_go(cache, monkeypatch):
    calls: list[tuple[int, ...]] = []
    squares = _counted(calls)
    versions = [f"v{i:02d}" for i in range(KEEP_VERSIONS + 2)]
    for i, version in enumerate(versions):
        monkeypatch.setattr(kept_counts, "code_version", lambda v=version: v)
        assert squares(5) == (25,)
        os.utime(cache / "squares" / version, (i, i))  # made in turn, not in one second
    assert len(calls) == len(versions)
    assert sorted(p.name for p in (cache / "squares").iterdir()) == versions[2:]


@pytest.mark.parametrize("damage", ["", "{not json", '{"key": "(7,)"}',
                                    '{"key": "(7,)", "value": ["x"]}',
                                    '{"key": "(8,)", "value": [64]}'])
def test_a_damaged_or_foreign_file_is_counted_again_and_rewritten(cache, damage):
    calls: list[tuple[int, ...]] = []
    squares = _counted(calls)
    squares(7)
    (path,) = (cache / "squares" / kept_counts.code_version()).iterdir()
    path.write_text(damage)
    assert squares(7) == (49,) and len(calls) == 2
    assert squares(7) == (49,) and len(calls) == 2  # rewritten whole


def test_an_empty_setting_or_an_unwritable_folder_keeps_nothing_and_still_counts(
        tmp_path, monkeypatch):
    calls: list[tuple[int, ...]] = []
    squares = _counted(calls)
    monkeypatch.setenv(CACHE_ENV, "")
    assert squares(4) == (16,) and squares(4) == (16,) and len(calls) == 2
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))  # under a file: cannot be made
    assert squares(4) == (16,) and len(calls) == 3
    assert blocker.read_text() == ""


def test_the_default_folder_is_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kept_counts.cache_root() == tmp_path / "parabench"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert kept_counts.cache_root() == tmp_path / ".cache" / "parabench"


TOY = Program(Workload("toy", 32, 4), (), (0,), (4,), (("F", 0, 0), ("B", 0, 0)))


def test_a_footprint_read_back_in_another_process_is_the_one_counted(cache):
    counted = fake_step.simulate.__wrapped__(TOY)  # in this process, kept on disk
    assert counted.trace  # a real count: its allocations, in order
    child = ("from bench_lib.prediction import fake_step\n"
             "from bench_lib.prediction.fake_step import Program\n"
             "from bench_lib.workloads import Workload\n"
             "fake_step._run = None  # reading it back counts nothing\n"
             f"print(repr(fake_step.simulate({TOY!r})))\n")
    done = subprocess.run([PYTHON, "-c", child], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, CACHE_ENV: str(cache)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == repr(counted)
