"""Writing a run folder: its name, the folder itself and its ``latest-<command>`` link,
whole CSV rows appended case by case.

Rows are appended whole, flushed and fsynced as each case ends, so a crash at any point
leaves parseable files holding every finished case; a case's row in cases.csv is its commit
point, written after its step, timeline and sample rows. The running workload's rows after
each of its rounds (``write_provisional``) follow the final rows, each round's replacing the
last, until its final rows replace them. ``prepare_resume`` repairs what a crash left
behind. Never imports torch.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import re
import socket
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from bench_lib.results.read import done_case_ids, provisional_round, read_cases
from bench_lib.results.schema import (
    ADDED_CASE_COLUMNS,
    ADDED_SAMPLE_COLUMNS,
    CASE_COLUMNS,
    SAMPLE_COLUMNS,
    STATUSES,
    STEP_COLUMNS,
    TIMELINE_COLUMNS,
    ResultsError,
)

Row = Mapping[str, Any]


RUN_COMMANDS = ("run", "tune", "parity", "distance", "merge")
"""The commands that write run folders; each names its folders after itself and keeps a
``latest-<command>`` link to its newest one beside them."""
LATEST_PREFIX = "latest-"


def safe_name(text: str) -> str:
    """``text`` as a file name part: letters, digits, ``.`` and ``-`` kept, runs of anything
    else (``_``, the fields' separator, too) one ``-``; at most 40 characters."""
    kept = re.sub(r"[^A-Za-z0-9.-]+", "-", text).strip(".-")[:40].strip(".-")
    return kept or "x"


def new_run_id(sha: str | None, command: str, profile: str | None = None) -> str:
    """``<UTC time>_<host>_<git sha7>_<command>[-<profile>]``, e.g.
    ``20261124T190000Z_node1_abc1234_run-smoke``: a folder says what made it."""
    if command not in RUN_COMMANDS:
        raise ValueError(f"unknown command {command!r}; valid: {', '.join(RUN_COMMANDS)}")
    now = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    host = safe_name(socket.gethostname().split(".")[0] or "host")
    what = command + (f"-{safe_name(profile)}" if profile else "")
    return f"{now}_{host}_{(sha or 'nogit')[:7]}_{what}"


def make_results_root(root: Path) -> None:
    """The folder that run folders go in (``--out``), made where it is missing. One that
    cannot be made is a ``ResultsError`` (a usage error: exit 2); a run makes it before its
    fork server starts, so that a bad ``--out`` is refused in a moment, not after the
    server's imports (after the pre-flight, which must leave nothing behind when it fails)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ResultsError(f"cannot create the results folder {root}: {e.strerror or e}") from None


def create_run_dir(root: Path, run_id: str) -> Path:
    """Make a fresh run folder; two runs started in the same second get distinct folders.

    A ``root`` that cannot be created is a ``ResultsError`` (a usage error: exit 2).
    """
    make_results_root(root)
    for attempt in range(1000):
        path = root / (run_id if attempt == 0 else f"{run_id}-{attempt + 1}")
        try:
            path.mkdir()  # atomic: exactly one concurrent run wins each name
            return path
        except FileExistsError:
            continue
        except OSError as e:
            raise ResultsError(f"cannot create a run folder in {root}: {e.strerror or e}") from None
    raise ResultsError(f"could not create a run folder under {root}")


def latest_link(root: Path, command: str) -> Path:
    """Where ``command``'s newest run folder under ``root`` is linked: ``latest-<command>``."""
    return root / f"{LATEST_PREFIX}{command}"


def link_latest(run_dir: Path, command: str) -> None:
    """Point ``latest-<command>`` beside ``run_dir`` at it (a relative link, replaced
    atomically: a reader sees the old folder or the new one). A link that cannot be made
    (a file system without links, a folder of that name) costs a warning, not the run."""
    link = latest_link(run_dir.parent, command)
    tmp = run_dir.parent / f".{link.name}.{os.getpid()}.tmp"
    try:
        tmp.unlink(missing_ok=True)
        os.symlink(run_dir.name, tmp)
        os.replace(tmp, link)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        print(f"warning: could not point {link} at {run_dir.name}: {e.strerror or e}",
              file=sys.stderr)


def start_run_dir(root: Path, sha: str | None, command: str, profile: str | None = None
                  ) -> Path:
    """A new run folder of ``command`` under ``root`` (``new_run_id``), linked as its
    ``latest-<command>`` as soon as it exists."""
    run_dir = create_run_dir(root, new_run_id(sha, command, profile))
    link_latest(run_dir, command)
    return run_dir


def write_json_atomic(path: Path, data: object) -> None:
    """Write JSON through a temporary file and a rename, so readers never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


class _Appender:
    """A CSV file that gets whole rows appended, flushed and synced one at a time."""

    def __init__(self, path: Path, columns: list[str]) -> None:
        new = not path.exists() or path.stat().st_size == 0
        self._file: TextIO = path.open("a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=columns, extrasaction="raise")
        if new:
            self._writer.writeheader()
            self._sync()

    def write(self, rows: Iterable[Row]) -> None:
        self._writer.writerows(rows)
        self._sync()

    def _sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def end(self) -> int:
        """The file's size in bytes: where the next row goes."""
        self._file.flush()
        return os.fstat(self._file.fileno()).st_size

    def cut(self, size: int) -> None:
        """Drop every byte after ``size`` (rows appended since it was the end); the next
        rows go there (the file is opened to append). Nothing to drop: nothing done."""
        if self.end() <= size:
            return
        os.ftruncate(self._file.fileno(), size)
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


class RunWriter:
    """Appends case rows and their step, timeline and sample rows to a run folder."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.run_id = run_dir.name
        # Steps first: a case row is the commit point, written after its steps.
        self._steps = _Appender(run_dir / "steps.csv", STEP_COLUMNS)
        # A resumed folder keeps its header: one written before a column was added
        # (``schema.Column.added``) goes on without it.
        self._case_columns = _header(run_dir / "cases.csv") or CASE_COLUMNS
        self._cases = _Appender(run_dir / "cases.csv", self._case_columns)
        # Where the final rows end: the running workload's provisional rows lie beyond it.
        self._final_end = self._cases.end()
        self._timeline: _Appender | None = None  # created by the first pipelined case
        self._samples: _Appender | None = None  # created by the first sampled case
        self._sample_columns = SAMPLE_COLUMNS

    def write_case(self, row: Row, steps: Iterable[Row] = (), timeline: Iterable[Row] = (),
                   samples: Iterable[Row] = ()) -> None:
        """Record one case (its step, timeline and sample rows first, then the case row),
        dropping the provisional rows first (``write_provisional``)."""
        full = self._full(row)
        if full.get("provisional"):
            raise ValueError(f"{row['case_id']}: a provisional row goes to write_provisional")
        self._cases.cut(self._final_end)
        ids = {"run_id": self.run_id, "case_id": row["case_id"]}
        self._steps.write([ids | dict(s) for s in steps])
        timeline, samples = list(timeline), list(samples)
        if timeline:
            if self._timeline is None:
                self._timeline = _Appender(self.run_dir / "timeline.csv", TIMELINE_COLUMNS)
            self._timeline.write([ids | dict(e) for e in timeline])
        if samples:
            if self._samples is None:
                # As cases.csv: a resumed folder's samples.csv keeps its header.
                path = self.run_dir / "samples.csv"
                self._sample_columns = _header(path) or SAMPLE_COLUMNS
                self._samples = _Appender(path, self._sample_columns)
            self._samples.write([{k: v for k, v in (ids | dict(s)).items()
                                  if k in self._sample_columns
                                  or k not in ADDED_SAMPLE_COLUMNS} for s in samples])
        self._cases.write([full])
        self._final_end = self._cases.end()

    def write_provisional(self, rows: Iterable[Row]) -> None:
        """Replace the running workload's provisional rows (each with its ``provisional``
        cell) in cases.csv, after the final rows; their step, timeline and sample rows come
        with the final rows alone. A folder resumed from before the column gets none (its
        rows could not say they are provisional)."""
        if "provisional" not in self._case_columns:
            return
        full = [self._full(r) for r in rows]
        if not all(r.get("provisional") for r in full):
            raise ValueError("a provisional row needs its provisional cell")
        self._cases.cut(self._final_end)
        self._cases.write(full)

    def _full(self, row: Row) -> dict[str, Any]:
        """``row`` as this folder's cases.csv row: every column, the run id, the status
        checked, and columns added after a resumed folder's header left out."""
        if row["status"] not in STATUSES:
            raise ValueError(f"bad status {row['status']!r}; valid: {', '.join(STATUSES)}")
        full = {c: "" for c in CASE_COLUMNS} | {"run_id": self.run_id} | dict(row)
        return {k: v for k, v in full.items()
                if k in self._case_columns or k not in ADDED_CASE_COLUMNS}

    def close(self) -> None:
        self._steps.close()
        self._cases.close()
        if self._timeline is not None:
            self._timeline.close()
        if self._samples is not None:
            self._samples.close()

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _header(path: Path) -> list[str] | None:
    """A CSV file's header, or None where the file is missing or empty."""
    if not path.exists() or path.stat().st_size == 0:
        return None
    with path.open(newline="") as f:
        return next(csv.reader(f), None)


def _drop_partial_last_line(path: Path) -> None:
    """Cut a last line that a crash left without its newline."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with path.open("r+b") as f:
            f.truncate(cut)


def check_resumable(run_dir: Path) -> None:
    """Refuse a folder whose cases.csv cannot be read as this schema, before touching it.

    Only a last line cut short by a crash is forgiven (``prepare_resume`` drops it); a
    header cut short, a missing ``case_id`` column or a hand-edited file is refused.
    """
    path = run_dir / "cases.csv"
    if not path.exists():
        return  # the run died before its first case: nothing recorded, nothing to lose
    data = path.read_bytes()
    if b"\n" not in data:
        raise ResultsError(f"cannot resume {run_dir}: {path} has no complete header line "
                           "(cut short?); nothing was changed")
    whole = data[: data.rfind(b"\n") + 1]
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp)
        (copy / "cases.csv").write_bytes(whole)
        (copy / "env.json").write_bytes((run_dir / "env.json").read_bytes())
        try:
            read_cases(copy)
        except ResultsError as e:
            raise ResultsError(f"cannot resume {run_dir}: {e}; nothing was changed") from None


def prepare_resume(run_dir: Path) -> set[str]:
    """Make an interrupted run folder consistent again; returns the recorded case ids.

    A case row is the commit point of a case: step, timeline and sample rows of cases
    without one (the case that was running when the run died) are dropped, so the rerun
    adds them once; so are the provisional rows of the workload that was running
    (``RunWriter.write_provisional``), which the rerun runs again. A folder that cannot be
    read as this schema is refused with a ``ResultsError`` before any file is touched.
    """
    check_resumable(run_dir)
    for name in ("cases.csv", "steps.csv", "timeline.csv", "samples.csv"):
        if (run_dir / name).exists():
            _drop_partial_last_line(run_dir / name)
    done = done_case_ids(run_dir)  # final rows only
    for name in ("cases.csv", "steps.csv", "timeline.csv", "samples.csv"):
        if (run_dir / name).exists():
            _keep_rows_of(run_dir / name, done)
    return done


def _keep_rows_of(path: Path, case_ids: set[str]) -> None:
    """Rewrite ``path`` (atomically, only where it changes) with the rows of ``case_ids``;
    cases.csv keeps its final rows alone, a provisional row of one of them included."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        columns, rows = list(reader.fieldnames or []), list(reader)
    kept = [r for r in rows if r.get("case_id") in case_ids
            and provisional_round(r.get("provisional")) is None]
    if len(kept) != len(rows):
        tmp = path.with_name(f".{path.name}.tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(kept)
        os.replace(tmp, path)
