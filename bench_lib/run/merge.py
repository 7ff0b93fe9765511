"""Joining shards: ``python -m bench_lib merge RUN_DIR... [--out DIR]`` turns the run folders
of ``run --shard K/N`` (``run.shard``) into one run folder that reports and compares like
any other: ``<UTC time>_<host>_<git sha7>_merge-<profile>`` in ``DIR`` (default ``results``,
the folder that receives a run folder, as ``run --out`` is), linked there as
``latest-merge``.

Refused before anything is written (``MergeError``, exit 2), naming the folders at fault:
a folder that is not a shard; shards of different sweeps (env.json ``sweep.id``) or of
different hardware (the hardware fingerprint, ``results.fingerprint.hardware_of``: what compare
refuses to set side by side); shards of different N; a shard given twice; a missing shard;
a shard that has not recorded every case of its part (interrupted: finish it with
``run --resume``); shards whose parts overlap or leave cases out (cut by different versions
of the suite); and a sweep this version of the suite expands differently from the shards'
(its case order and ``single`` pairing would not be theirs). ``allow_partial`` merges an
incomplete set anyway, recording what is missing in env.json.

What the merged folder holds, written into a temporary sibling and renamed into place (over
the empty folder that claimed its name), so a failure leaves nothing half-written:

* ``cases.csv``: every shard's rows in the sweep's case order, the speedup columns filled
  again by the runner's own ``SpeedupTable`` against the merged ``single`` rows (a shard
  holds whole workload groups, so each case meets the ``single`` it was measured beside);
  ``steps.csv``, ``timeline.csv``, ``samples.csv``: the shards' rows in the same order;
  every ``run_id`` is the merged folder's name, as in any run folder.
* ``env.json``: the first shard's, with the merge's command line and ``sweep`` saying where
  each shard came from (``merged_from``) and what is missing (``partial``);
  ``shards/<K>/``: each shard's own env.json (its host, FLOP peak, idle power, command) and
  any file of the shard this merge does not know; ``.work/``: the failed cases' logs.
  Figures, report.html and compare outputs are not copied: ``report`` the merged folder.

It lives beside the runner, not in ``results/``, because it expands the sweep and fills
speedups with ``rows.speedup_table``, which imports torch; ``results/`` never does.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_lib.results.cells import Row
from bench_lib.results.fingerprint import fingerprint_id, hardware_of
from bench_lib.results.read import provisional_round, read_cases, read_env, run_dirs_in
from bench_lib.results.store import (
    RunWriter,
    create_run_dir,
    link_latest,
    new_run_id,
    write_json_atomic,
)
from bench_lib.rig import Rig
from bench_lib.rows.speedup_table import EFFICIENCY_COLUMNS, SPEEDUP_COLUMNS, SpeedupTable
from bench_lib.run.shard import Shard, SweepRecord, sweep_id
from bench_lib.sweep.cases import Case
from bench_lib.sweep.expansion import expand
from bench_lib.sweep.profile import Profile, UsageError

CASE_FILES = ("steps.csv", "timeline.csv", "samples.csv")
"""Per-case row files, merged case by case beside cases.csv."""
DERIVED = {"report.html", "compare.md", "compare.json"}
"""Outputs made from a run folder (and PNG figures): made again from the merged one."""


class MergeError(UsageError):
    """Shards that cannot be joined into one run folder: exit 2, nothing written."""


@dataclass(frozen=True)
class ShardRun:
    """One shard's run folder, read and checked against the schema."""

    path: Path
    env: dict[str, Any]
    sweep: SweepRecord
    shard: Shard
    rows: list[Row]
    """cases.csv rows as written (text), in file order."""

    @property
    def name(self) -> str:
        return f"shard {self.shard.label} ({self.path})"


def run_folders(paths: Sequence[Path]) -> list[Path]:
    """Each path as given where it is a run folder (holds env.json), else the run folders
    directly in it (a ``run --out`` target): ``merge results/job-*/`` works either way."""
    out: list[Path] = []
    for path in paths:
        if (path / "env.json").is_file():
            out.append(path)
            continue
        inside = run_dirs_in(path)
        if not inside:
            raise MergeError(f"{path} is not a run folder and holds none (no env.json)")
        out += inside
    return out


def _read_rows(path: Path) -> list[Row]:
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def read_shard(path: Path) -> ShardRun:
    """A shard's run folder; a ``MergeError`` for a folder run without ``--shard``."""
    env = read_env(path)
    sweep = SweepRecord.of_env(env)
    if sweep is None or sweep.shard is None:
        raise MergeError(f"{path} is not a shard: it was run without --shard (its env.json "
                         "names no shard of a sweep)")
    if (path / "cases.csv").is_file():
        read_cases(path)  # refuse a truncated or hand-edited cases.csv before using it
    # A workload stopped mid-way left provisional rows: not done (resume the shard).
    rows = [r for r in _read_rows(path / "cases.csv")
            if provisional_round(r.get("provisional")) is None]
    return ShardRun(path, env, sweep, sweep.shard, rows)


def _same(shards: Sequence[ShardRun], what: str, key: Any) -> None:
    """Refuse shards that differ in ``key(shard)``, naming each value's shards."""
    by: dict[str, list[str]] = {}
    for s in shards:
        by.setdefault(str(key(s)), []).append(s.name)
    if len(by) > 1:
        parts = "; ".join(f"{v}: {', '.join(names)}" for v, names in by.items())
        raise MergeError(f"these are not shards of one sweep: they differ in {what} ({parts})")


def check_set(shards: Sequence[ShardRun], allow_partial: bool) -> list[int]:
    """Refuse shards that do not make up one sweep; returns the missing shard indices."""
    _same(shards, "sweep id", lambda s: s.sweep.id)
    _same(shards, "hardware fingerprint",
          lambda s: fingerprint_id(hardware_of(s.env.get("fingerprint") or {})))
    _same(shards, "shard count N", lambda s: s.shard.count)
    seen: dict[int, ShardRun] = {}
    for s in shards:
        if s.shard.index in seen:
            raise MergeError(f"shard {s.shard.label} is given twice: {seen[s.shard.index].path} "
                             f"and {s.path}")
        seen[s.shard.index] = s
    count = shards[0].shard.count
    missing = [k for k in range(1, count + 1) if k not in seen]
    if missing and not allow_partial:
        raise MergeError(f"shard(s) {', '.join(f'{k}/{count}' for k in missing)} missing: "
                         "run them (or pass --allow-partial to merge what there is)")
    return missing


def check_parts(shards: Sequence[ShardRun], cases: Sequence[Case],
                allow_partial: bool) -> list[str]:
    """Refuse shards whose parts overlap, fall outside the sweep or (unless
    ``allow_partial``) are unfinished; returns the ids of the cases not recorded."""
    owner: dict[str, str] = {}
    for s in shards:
        for cid in s.sweep.shard_case_ids:
            if cid in owner:
                raise MergeError(f"case {cid} belongs to {owner[cid]} and to {s.name}: the "
                                 "shards were cut differently (another suite version?)")
            owner[cid] = s.name
    sweep_ids = {c.case_id for c in cases}
    outside = sorted(set(owner) - sweep_ids)
    if outside:
        raise MergeError(f"case {outside[0]} of {owner[outside[0]]} is not in the sweep")
    if len(shards) == shards[0].shard.count and set(owner) != sweep_ids:
        lost = sorted(sweep_ids - set(owner))
        raise MergeError(f"{len(lost)} case(s) of the sweep belong to no shard (e.g. {lost[0]}): "
                         "the shards were cut differently (another suite version?)")
    not_recorded: list[str] = []
    for s in shards:
        part, done = set(s.sweep.shard_case_ids), {r["case_id"] for r in s.rows}
        stray = sorted(done - part)
        if stray:
            raise MergeError(f"{s.name} records case {stray[0]}, which is not in its part")
        left = [cid for cid in s.sweep.shard_case_ids if cid not in done]
        if left and not allow_partial:
            raise MergeError(f"{s.name} has not recorded {len(left)} of its "
                             f"{len(part)} cases (e.g. {left[0]}): finish it with "
                             f"`python -m bench_lib run --resume {s.path}` (or pass "
                             "--allow-partial)")
        not_recorded += left
    return not_recorded


def expand_sweep(shard: ShardRun) -> list[Case]:
    """The whole sweep a shard belongs to, as this suite expands it (run order); refused
    where it is not the sweep the shard recorded."""
    rig, profile = Rig.from_dict(shard.env["rig"]), Profile.from_dict(shard.env["profile"])
    if rig.nodes > 1:  # planned as the multi-node run planned it, on every node's devices
        from bench_lib.nodes.multinode import plan_nodes

        _, cases = plan_nodes(profile, dataclasses.replace(rig, nodes=1), rig.nodes)
    else:
        cases = expand(profile, rig)
    here = sweep_id(profile, rig, cases)
    if here != shard.sweep.id:
        sha = (shard.env.get("git") or {}).get("sha") or "?"
        raise MergeError(f"this version of the suite expands the shards' profile into sweep "
                         f"{here}, not their {shard.sweep.id}: merge with the version that ran "
                         f"them (git {sha[:7]})")
    return cases


def merged_rows(shards: Sequence[ShardRun], cases: Sequence[Case]) -> list[tuple[Case, Row]]:
    """Every recorded case row in sweep order, its speedup columns filled again against the
    merged ``single`` rows by the runner's ``SpeedupTable`` (``baselines_first`` order puts
    each workload's single first)."""
    by_id = {r["case_id"]: dict(r) for s in shards for r in s.rows}
    speedups = SpeedupTable()
    out = []
    for case in cases:
        row = by_id.get(case.case_id)
        if row is None:
            continue
        row |= dict.fromkeys((*SPEEDUP_COLUMNS, *EFFICIENCY_COLUMNS), "")
        speedups.fill(case, row)
        out.append((case, row))
    return out


def _by_case(shards: Sequence[ShardRun], name: str) -> dict[str, list[Row]]:
    """A per-case file's rows of every shard, by case id, without their run_id."""
    out: dict[str, list[Row]] = {}
    for s in shards:
        for r in _read_rows(s.path / name):
            r.pop("run_id", None)
            out.setdefault(r.pop("case_id"), []).append(r)
    return out


def _copy_extras(shard: ShardRun, run_dir: Path) -> None:
    """The shard's env.json and unknown files into ``shards/<K>/``; its ``.work`` (failed
    cases' logs, by case id) into the merged ``.work``."""
    dest = run_dir / "shards" / str(shard.shard.index)
    dest.mkdir(parents=True)
    shutil.copy2(shard.path / "env.json", dest / "env.json")
    known = {"env.json", "cases.csv", *CASE_FILES, *DERIVED}
    for item in sorted(shard.path.iterdir()):
        if item.name == ".work" and item.is_dir():
            shutil.copytree(item, run_dir / ".work", dirs_exist_ok=True)
        elif item.name in known or item.suffix == ".png" or item.name.startswith("."):
            continue
        elif item.is_dir():
            shutil.copytree(item, dest / item.name)
        else:
            shutil.copy2(item, dest / item.name)


def merged_env(shards: Sequence[ShardRun], missing_shards: list[int],
               missing_cases: list[str], argv: list[str]) -> dict[str, Any]:
    """The first shard's env.json, with the merge's command line and its provenance."""
    first = shards[0]
    env = copy.deepcopy(first.env)
    env["command_line"] = argv
    sweep = SweepRecord(first.sweep.id, first.sweep.cases, first.sweep.workloads).as_dict()
    sweep["merged_from"] = [
        {"shard": s.shard.label, "run_id": s.path.name, "path": str(s.path),
         "hostname": s.env.get("hostname"), "git_sha": (s.env.get("git") or {}).get("sha"),
         "torch": (s.env.get("versions") or {}).get("torch"), "cases": len(s.rows)}
        for s in shards]
    if missing_shards or missing_cases:
        count = first.shard.count
        sweep["partial"] = {"missing_shards": [f"{k}/{count}" for k in missing_shards],
                            "missing_cases": missing_cases}
    env["sweep"] = sweep
    return env


def _software_note(shards: Sequence[ShardRun]) -> str:
    """A warning where shards ran different code or torch (allowed: compare notes it too)."""
    seen = {((s.env.get("git") or {}).get("sha"), (s.env.get("versions") or {}).get("torch"))
            for s in shards}
    if len(seen) < 2:
        return ""
    return ("warning: the shards ran different git commits or torch versions "
            f"({'; '.join(f'{sha and sha[:7]} torch {t}' for sha, t in sorted(seen, key=str))}); "
            "each workload's speedups are within one shard, but step times across them "
            "are not like for like")


def write_merged(out: Path, shards: Sequence[ShardRun], rows: list[tuple[Case, Row]],
                 env: dict[str, Any]) -> None:
    """Write the merged run folder into a temporary sibling, check it, rename it to ``out``
    (absent, or the empty folder ``create_run_dir`` claimed)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.merging-{os.getpid()}"
    run_dir = staging / out.name  # the folder's name is every row's run_id
    try:
        run_dir.mkdir(parents=True)
        write_json_atomic(run_dir / "env.json", env)
        per_case = {name: _by_case(shards, name) for name in CASE_FILES}
        with RunWriter(run_dir) as writer:
            for _case, row in rows:
                cid = row["case_id"]
                row.pop("run_id", None)
                writer.write_case(row, *(per_case[name].get(cid, []) for name in CASE_FILES))
        for shard in shards:
            _copy_extras(shard, run_dir)
        read_cases(run_dir)  # what report and compare will read
        os.rename(run_dir, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def merge(paths: Sequence[Path], root: Path, allow_partial: bool = False,
          argv: list[str] | None = None, sha: str | None = None) -> Path:
    """Join the shards in ``paths`` into a new run folder under ``root`` (module docstring;
    ``sha``: this checkout's, for its name); returns the folder. Progress and warnings go to
    stderr."""
    if (root / "env.json").is_file():
        raise MergeError(f"--out {root} is a run folder: --out names the folder that receives "
                         "the merged run folder (default: results)")
    shards = sorted((read_shard(p) for p in run_folders(paths)), key=lambda s: s.shard.index)
    for s in shards:
        print(f"{s.name}: {len(s.rows)} of {len(s.sweep.shard_case_ids)} cases recorded",
              file=sys.stderr)
    missing_shards = check_set(shards, allow_partial)
    cases = expand_sweep(shards[0])
    missing_cases = check_parts(shards, cases, allow_partial)
    if note := _software_note(shards):
        print(note, file=sys.stderr)
    rows = merged_rows(shards, cases)
    env = merged_env(shards, missing_shards, missing_cases,
                     list(sys.argv if argv is None else argv))
    name = new_run_id(sha, "merge", str((shards[0].env.get("profile") or {}).get("name", "")))
    out = create_run_dir(root, name)  # claims the name: renamed over once written
    try:
        write_merged(out, shards, rows, env)
    except BaseException:
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise
    link_latest(out, "merge")
    partial = (f" (partial: {len(missing_shards)} shard(s) and {len(missing_cases)} case(s) "
               "of the shards given missing)" if missing_shards or missing_cases else "")
    print(f"merged {len(rows)} of {len(cases)} cases from {len(shards)} shard(s) into "
          f"{out}{partial}", file=sys.stderr)
    return out
