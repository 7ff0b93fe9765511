"""Reading a run folder, checked against the schema: anything else is a ``ResultsError``.

Never imports torch (pandas only where a table is returned).
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench_lib.results.schema import (
    ADDED_CASE_COLUMNS,
    CASE_COLUMNS,
    NUMERIC_CASE_COLUMNS,
    OPTIONAL_STEP_COLUMNS,
    SCHEMA_VERSION,
    STATUSES,
    STEP_COLUMNS,
    ResultsError,
)

if TYPE_CHECKING:
    import pandas as pd


def number(value: object) -> float | None:
    """A cell read from a CSV (or a row) as a finite float; None where it is empty, NaN,
    infinite or no number."""
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def read_env(run_dir: Path) -> dict[str, Any]:
    """Read env.json, refusing other schema versions."""
    path = run_dir / "env.json"
    if not path.is_file():
        raise ResultsError(f"{run_dir} is not a run folder: env.json is missing")
    try:
        env: dict[str, Any] = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ResultsError(f"{path} is not valid JSON: {e}") from None
    version = env.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ResultsError(
            f"{run_dir} was written with results schema version {version}; this version of "
            f"the suite reads version {SCHEMA_VERSION} (run the sweep again to read it here)"
        )
    return env


def devices_label(env: dict[str, Any]) -> str:
    """env.json's devices in words, the one summary every label takes (the report's captions
    and runs table, gpu_check's header): ``2x NVIDIA H100 80GB HBM3``; a cpu rig's workers by
    their cores; the validation mode's slots as the GPUs they share (env.json names a device
    per slot, so counting names would count one card twice):
    ``1x NVIDIA H100 80GB HBM3 shared by 2 slots (validation mode)``."""
    names = [str(n) for n in env.get("device_names") or []]
    rig = env.get("rig") or {}
    if not names:
        return "no device names"
    if rig.get("kind") == "cpu":  # each worker is its own cores: named one by one
        return ", ".join(names)
    slots = int(rig.get("gpu_slots") or 1)
    gpus = names[::slots]  # slot i is on GPU i // slots
    counted = ", ".join(f"{gpus.count(n)}x {n}" for n in dict.fromkeys(gpus))
    if slots == 1:
        return counted
    per_gpu = f"{slots} per GPU, " if len(gpus) > 1 else ""
    return f"{counted} shared by {len(names)} slots ({per_gpu}validation mode)"


def read_cases(run_dir: Path) -> pd.DataFrame:
    """cases.csv as a pandas DataFrame, checked against the schema."""
    import pandas as pd

    read_env(run_dir)
    path = run_dir / "cases.csv"
    try:
        df = pd.read_csv(path, keep_default_na=False, na_values=[""])
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise ResultsError(f"cannot read {path}: {e}") from None
    missing = [c for c in CASE_COLUMNS if c not in df.columns and c not in ADDED_CASE_COLUMNS]
    if missing:
        raise ResultsError(
            f"{path} lacks columns {', '.join(missing)}: not schema {SCHEMA_VERSION}"
        )
    absent = [c for c in ADDED_CASE_COLUMNS if c not in df.columns]  # written before them
    # One block per dtype: pandas reads a column a block, and warns of a frame that
    # fragmented (over 100 blocks) on every later assign.
    df = pd.concat([df, pd.DataFrame(float("nan"), index=df.index, columns=absent)],
                   axis=1).copy()
    _check_cases(path, df)
    bad = sorted(set(df["status"].astype(str)) - set(STATUSES))
    if bad:
        raise ResultsError(f"{path} has unknown status values {bad}; valid: {', '.join(STATUSES)}")
    return df


def _check_cases(path: Path, df: pd.DataFrame) -> None:
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


def read_table(path: Path, required: Sequence[str]) -> pd.DataFrame:
    """One of a run folder's CSV files, refused when unreadable or missing ``required``."""
    import pandas as pd

    try:
        df = pd.read_csv(path)
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise ResultsError(f"cannot read {path}: {e}") from None
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise ResultsError(f"{path} lacks columns {', '.join(missing)}")
    return df


def read_steps(run_dir: Path) -> pd.DataFrame:
    """steps.csv as a DataFrame (every rank's every timed step), checked for its columns."""
    return read_table(run_dir / "steps.csv",
                      [c for c in STEP_COLUMNS if c not in OPTIONAL_STEP_COLUMNS])


def done_case_ids(run_dir: Path) -> set[str]:
    """Case ids already recorded in a run folder (for resuming): final rows only, a
    provisional row (``provisional_round``) is a workload still running when the run
    stopped, which a resume runs again."""
    path = run_dir / "cases.csv"
    if not path.exists():
        return set()
    with path.open(newline="") as f:
        return {row["case_id"] for row in csv.DictReader(f)
                if row.get("case_id") and provisional_round(row.get("provisional")) is None}


def provisional_text(done: int, rounds: int) -> str:
    """cases.csv's ``provisional`` cell of a row made after round ``done`` of ``rounds``."""
    return f"after round {done} of {rounds}"


def provisional_round(value: object) -> tuple[int, int] | None:
    """A ``provisional`` cell as (rounds done, rounds of its workload); None for a final
    row (an empty cell, a NaN from pandas, or a folder written before the column)."""
    found = _PROVISIONAL.fullmatch(value.strip()) if isinstance(value, str) else None
    return (int(found[1]), int(found[2])) if found else None


_PROVISIONAL = re.compile(r"after round (\d+) of (\d+)")


def provisional_words(values: Iterable[object]) -> str:
    """What provisional rows mean for their figures, from the ``provisional`` cells of the
    rows shown: ``after round 1 of 3: one launch per case, no intervals`` or ``after round
    2 of 3: 2 launches so far``; empty where every row is final."""
    found = [r for r in (provisional_round(v) for v in values) if r is not None]
    if not found:
        return ""
    done, rounds = min(found)  # only one workload runs at a time: they agree
    so_far = ("one launch per case, no intervals" if done == 1
              else f"{done} launches so far, intervals that later rounds narrow")
    return f"provisional, {provisional_text(done, rounds)}: {so_far}"


def run_dirs_in(out: Path) -> list[Path]:
    """The run folders directly under ``out`` (a ``run --out`` target), oldest name first;
    not the ``latest-<command>`` links beside them (each a second name of one of them).

    Scripts give each run a fresh ``--out`` and take the one folder found here, rather than
    reading the run folder off the command's output.
    """
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir() if not p.is_symlink() and (p / "env.json").is_file())
