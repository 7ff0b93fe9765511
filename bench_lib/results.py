"""The results schema (versioned), the run folder, its writers and readers.

A run folder ``results/<run_id>/`` holds::

    env.json     environment, rig, profile, command line, schema version
    cases.csv    exactly one row per case, whatever happened to it
    steps.csv    every timed step of every rank: run_id, case_id, rank, step, step_time_s
    timeline.csv pipelined cases only: per stage and micro-batch, forward/backward start and end
    samples.csv  the sampler's readings while each case ran: time_unix_s, device, metrics

Rows are appended whole and flushed to disk as each case ends, so a crash at any point
leaves parseable files holding every finished case.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import socket
import subprocess
from pathlib import Path

from bench_lib.monitor import SAMPLE_METRICS

SCHEMA_VERSION = 1
STATUSES = ("ok", "oom", "unsupported", "skipped", "timeout", "error")

CASE_COLUMNS = [
    "run_id", "case_id", "strategy", "model", "rig", "world_size", "threads_per_worker",
    "image_size", "batch_size", "split_size", "num_microbatches", "precision", "loss",
    "status", "reason", "warmup_steps", "timed_steps",
    "step_time_s_median", "step_time_s_mean", "step_time_s_stdev", "step_time_s_p10",
    "step_time_s_p90", "step_time_s_iqr", "step_time_s_ci_low", "step_time_s_ci_high",
    "throughput_img_s", "peak_mem_mib_max", "peak_mem_mib_by_device", "case_wall_time_s",
    "note",
    # Measurement depth: sampler summaries over the timed window, memory, energy, FLOPs.
    "stop_reason", "util_pct_mean", "util_pct_mean_by_device", "power_w_mean",
    "energy_j_per_img", "energy_source", "peak_mem_reserved_mib_max",
    "peak_mem_reserved_mib_by_device", "mem_imbalance_ratio", "flops_per_img",
    "achieved_tflop_s", "mfu_pct", "speedup_vs_single", "scaling_efficiency",
    # Options: stage cut (method:cut block indices), memory format, compile, SyncBatchNorm.
    "partition", "channels_last", "compile", "sync_bn",
]
# Option columns added within schema 1; older files lack them and ran with these values.
OPTION_COLUMN_DEFAULTS = {"partition": "", "channels_last": 0, "compile": 0, "sync_bn": 0}
STEP_COLUMNS = ["run_id", "case_id", "rank", "step", "step_time_s"]
SAMPLE_COLUMNS = ["run_id", "case_id", "time_unix_s", "device", *SAMPLE_METRICS]
TIMELINE_COLUMNS = ["run_id", "case_id", "rank", "stage", "device", "microbatch", "phase",
                    "start_s", "end_s"]


class ResultsError(ValueError):
    """A run folder that cannot be read (missing files, another schema version)."""


def git_info(repo: Path | None = None) -> dict:
    """The git sha and dirty flag of the code that ran (empty when not a git checkout)."""
    cwd = repo or Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}
    return {"sha": sha, "dirty": dirty}


def new_run_id(sha: str | None) -> str:
    """``<UTC time>_<host>_<git sha7>``."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    host = socket.gethostname().split(".")[0] or "host"
    return f"{now}_{host}_{(sha or 'nogit')[:7]}"


def create_run_dir(root: Path, run_id: str) -> Path:
    """Make a fresh run folder; two runs started in the same second get distinct folders."""
    root.mkdir(parents=True, exist_ok=True)
    for attempt in range(1000):
        path = root / (run_id if attempt == 0 else f"{run_id}-{attempt + 1}")
        try:
            path.mkdir()  # atomic: exactly one concurrent run wins each name
            return path
        except FileExistsError:
            continue
    raise ResultsError(f"could not create a run folder under {root}")


def write_json_atomic(path: Path, data: object) -> None:
    """Write JSON through a temporary file and a rename, so readers never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


class _Appender:
    """A CSV file that gets whole rows appended, flushed and synced one at a time."""

    def __init__(self, path: Path, columns: list[str]) -> None:
        new = not path.exists() or path.stat().st_size == 0
        self._file = path.open("a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=columns, extrasaction="raise")
        if new:
            self._writer.writeheader()
            self._sync()

    def write(self, rows: list[dict]) -> None:
        self._writer.writerows(rows)
        self._sync()

    def _sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


class RunWriter:
    """Appends case rows and their step rows to a run folder."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.run_id = run_dir.name
        # Steps first: a case row is the commit point, written after its steps.
        self._steps = _Appender(run_dir / "steps.csv", STEP_COLUMNS)
        self._cases = _Appender(run_dir / "cases.csv", CASE_COLUMNS)
        self._timeline: _Appender | None = None  # created by the first pipelined case
        self._samples: _Appender | None = None  # created by the first sampled case

    def write_case(self, row: dict, steps: list[dict] = (), timeline: list[dict] = (),
                   samples: list[dict] = ()) -> None:
        """Record one case (its step and timeline rows first, then the case row)."""
        if row["status"] not in STATUSES:
            raise ValueError(f"bad status {row['status']!r}; valid: {', '.join(STATUSES)}")
        full = {c: "" for c in CASE_COLUMNS} | {"run_id": self.run_id} | row
        ids = {"run_id": self.run_id, "case_id": row["case_id"]}
        self._steps.write([ids | s for s in steps])
        if timeline:
            if self._timeline is None:
                self._timeline = _Appender(self.run_dir / "timeline.csv", TIMELINE_COLUMNS)
            self._timeline.write([ids | e for e in timeline])
        if samples:
            if self._samples is None:
                self._samples = _Appender(self.run_dir / "samples.csv", SAMPLE_COLUMNS)
            self._samples.write([ids | s for s in samples])
        self._cases.write([full])

    def close(self) -> None:
        self._steps.close()
        self._cases.close()
        if self._timeline is not None:
            self._timeline.close()
        if self._samples is not None:
            self._samples.close()

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_env(run_dir: Path) -> dict:
    """Read env.json, refusing other schema versions."""
    path = run_dir / "env.json"
    if not path.is_file():
        raise ResultsError(f"{run_dir} is not a run folder: env.json is missing")
    try:
        env = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ResultsError(f"{path} is not valid JSON: {e}") from None
    version = env.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ResultsError(
            f"{run_dir} was written with results schema version {version}; this version of "
            f"the suite reads version {SCHEMA_VERSION}"
        )
    return env


def read_cases(run_dir: Path):
    """cases.csv as a pandas DataFrame, checked against the schema."""
    import pandas as pd

    read_env(run_dir)
    path = run_dir / "cases.csv"
    try:
        df = pd.read_csv(path, keep_default_na=False, na_values=[""])
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError) as e:
        raise ResultsError(f"cannot read {path}: {e}") from None
    for col, default in OPTION_COLUMN_DEFAULTS.items():
        if col not in df.columns:  # written before these columns existed: the defaults ran
            df[col] = default
    missing = [c for c in CASE_COLUMNS if c not in df.columns]
    if missing:
        raise ResultsError(
            f"{path} lacks columns {', '.join(missing)}: not schema {SCHEMA_VERSION}"
        )
    _check_cases(path, df)
    bad = sorted(set(df["status"].astype(str)) - set(STATUSES))
    if bad:
        raise ResultsError(f"{path} has unknown status values {bad}; valid: {', '.join(STATUSES)}")
    return df


# Columns that must hold numbers (or nothing); a word there means a hand-edited file.
NUMERIC_CASE_COLUMNS = [
    "world_size", "image_size", "batch_size", "split_size", "num_microbatches", "warmup_steps",
    "timed_steps", "step_time_s_median", "step_time_s_mean", "step_time_s_stdev",
    "step_time_s_p10", "step_time_s_p90", "step_time_s_iqr", "step_time_s_ci_low",
    "step_time_s_ci_high", "throughput_img_s", "peak_mem_mib_max", "case_wall_time_s",
]


def _check_cases(path: Path, df) -> None:
    """Refuse a truncated or hand-edited cases.csv: ragged rows, words in number columns."""
    import pandas as pd

    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        raise ResultsError(f"{path} ends in the middle of a row: truncated?")
    with path.open(newline="") as f:
        reader = csv.reader(f)
        width = len(next(reader, []))
        for line, row in enumerate(reader, start=2):
            if len(row) != width:
                raise ResultsError(f"{path} line {line} has {len(row)} fields, the header "
                                   f"{width}: truncated or hand-edited")
    for col in NUMERIC_CASE_COLUMNS:
        values = pd.to_numeric(df[col], errors="coerce")
        bad = df[col][values.isna() & df[col].notna()]
        if not bad.empty:
            raise ResultsError(f"{path} column {col} holds {bad.iloc[0]!r} (line "
                               f"{bad.index[0] + 2}); expected a number")
    ok = df[df["status"] == "ok"]
    if (pd.to_numeric(ok["step_time_s_median"]).fillna(0) <= 0).any():
        raise ResultsError(f"{path} has an ok case without a positive step_time_s_median")
    dupes = df["case_id"][df["case_id"].duplicated()]
    if not dupes.empty:
        raise ResultsError(f"{path} records case {dupes.iloc[0]!r} twice")


def _drop_partial_last_line(path: Path) -> None:
    """Cut a last line that a crash left without its newline."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with path.open("r+b") as f:
            f.truncate(cut)


def prepare_resume(run_dir: Path) -> set[str]:
    """Make an interrupted run folder consistent again; returns the recorded case ids.

    A case row is the commit point of a case: step and timeline rows of cases without one
    (the case that was running when the run died) are dropped, so the rerun adds them once.
    """
    read_env(run_dir)
    for name in ("cases.csv", "steps.csv", "timeline.csv"):
        if (run_dir / name).exists():
            _drop_partial_last_line(run_dir / name)
    done = done_case_ids(run_dir)
    for name in ("steps.csv", "timeline.csv", "samples.csv"):
        path = run_dir / name
        if not path.exists():
            continue
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            columns, rows = reader.fieldnames or [], list(reader)
        kept = [r for r in rows if r.get("case_id") in done]
        if len(kept) != len(rows):
            tmp = path.with_name(f".{name}.tmp")
            with tmp.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=columns)
                writer.writeheader()
                writer.writerows(kept)
            os.replace(tmp, path)
    return done


def done_case_ids(run_dir: Path) -> set[str]:
    """Case ids already recorded in a run folder (for resuming)."""
    path = run_dir / "cases.csv"
    if not path.exists():
        return set()
    with path.open(newline="") as f:
        return {row["case_id"] for row in csv.DictReader(f) if row.get("case_id")}
