"""Shards of a sweep: ``run --shard K/N`` runs the K-th of N parts, each into its own run
folder, so a sweep too big for one box runs as N jobs (a SLURM job array) and ``merge``
joins the folders after.

Decided here, before anything runs, from the sweep alone:

* **The unit is a workload group**: a workload's ``single`` case and every case compared with
  it, its batch-curve points too (``sweep.expansion.workload_groups``, the groups the
  runner measures in interleaved rounds). A group is never split: its speedups pair each
  case with its ``single`` round by round, which only means something within one run.
* **Balance by estimated duration** (``prediction.duration.case_seconds``): groups, longest first,
  each go to the shard with the least estimated time so far (fewest cases, then lowest
  index, on a tie): greedy list scheduling ("LPT"), so no shard is estimated more than the
  mean over shards plus the longest group, and within 4/3 of the best possible split.
  Deterministic: the same sweep on the same rig gives the same shards on every node.
* **The sweep's identity** (``sweep_id``): a hash of the expanded sweep (the profile, every
  case with its measurement settings and status, the rig's label), recorded in each shard's
  env.json (``SweepRecord``), so that ``merge`` joins only shards of one sweep. The shard
  record also lists its case ids: a resumed shard stays that shard, and merge can tell an
  unfinished one, whatever later estimates would say.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench_lib.prediction.duration import case_seconds, format_duration
from bench_lib.rig import Rig
from bench_lib.sweep.cases import Case
from bench_lib.sweep.expansion import workload_groups
from bench_lib.sweep.profile import Profile, UsageError


@dataclass(frozen=True)
class Shard:
    """The K-th (1-based) of N shards of a sweep."""

    index: int
    """K, from 1."""
    count: int
    """N, at least 1."""

    def __post_init__(self) -> None:
        if self.count < 1 or not 1 <= self.index <= self.count:
            raise UsageError(f"shard {self.index}/{self.count}: need 1 <= K <= N, "
                             f"e.g. 1/{max(self.count, 2)} to {max(self.count, 2)}/"
                             f"{max(self.count, 2)}")

    @property
    def label(self) -> str:
        """``K/N``."""
        return f"{self.index}/{self.count}"

    @classmethod
    def parse(cls, text: str) -> Shard:
        """``K/N`` -> Shard; anything else is a ``UsageError`` naming the form."""
        k, sep, n = text.strip().partition("/")
        if not sep or not k.strip().isdigit() or not n.strip().isdigit():
            raise UsageError(f"--shard takes K/N (the K-th of N shards, K from 1), "
                             f"e.g. 2/4; got {text!r}")
        return cls(int(k), int(n))


def balance(costs: Sequence[float], sizes: Sequence[int], count: int) -> list[int]:
    """The shard (0-based) of each group: longest group first to the least loaded shard.

    ``costs``: each group's estimated seconds; ``sizes``: its case count, the tie-break after
    the load (so groups estimated at 0, all skipped or unsupported, spread out too).
    Greedy list scheduling bounds every shard's load by mean + max(costs).
    """
    if count < 1:
        raise ValueError(f"need at least one shard, got {count}")
    load, cases = [0.0] * count, [0] * count
    shard_of = [0] * len(costs)
    for g in sorted(range(len(costs)), key=lambda g: (-costs[g], -sizes[g], g)):
        k = min(range(count), key=lambda k: (load[k], cases[k], k))
        shard_of[g] = k
        load[k] += costs[g]
        cases[k] += sizes[g]
    return shard_of


@dataclass(frozen=True)
class ShardPlan:
    """The sweep cut into shards: which cases each runs, and its estimated seconds."""

    case_ids: tuple[tuple[str, ...], ...]
    """Per shard (index K-1), its cases' ids in sweep order."""
    seconds: tuple[float, ...]
    """Per shard, its estimated duration."""
    workloads: tuple[int, ...]
    """Per shard, how many workload groups it holds."""


def cut_shards(cases: Sequence[Case], rig: Rig, count: int) -> ShardPlan:
    """Cut ``cases`` (the whole sweep, in run order) into ``count`` balanced shards.

    A ``UsageError`` where the sweep has fewer workload groups than shards: a shard with
    nothing to run is a job array task that wastes a node, and a sign of a mistyped N.
    """
    groups = workload_groups(cases)
    if count > len(groups):
        raise UsageError(f"--shard .../{count}: this sweep has {len(groups)} workload "
                         f"group(s) (a workload's single and the cases compared with it: the "
                         f"unit a shard takes, never split); use N <= {len(groups)}")
    estimates = [case_seconds(c, rig) for c in cases]
    costs = [sum(estimates[i] for i in g) for g in groups]
    shard_of = balance(costs, [len(g) for g in groups], count)
    members: list[list[int]] = [[] for _ in range(count)]
    for g, k in zip(groups, shard_of):
        members[k] += g
    return ShardPlan(
        case_ids=tuple(tuple(cases[i].case_id for i in sorted(m)) for m in members),
        seconds=tuple(sum(estimates[i] for i in m) for m in members),
        workloads=tuple(shard_of.count(k) for k in range(count)),
    )


def sweep_id(profile: Profile, rig: Rig, cases: Sequence[Case]) -> str:
    """A short hash of the expanded sweep: the profile (grid and measurement settings), every
    case as expanded on this rig (with its status, world size, micro-batching and
    measurement) and the rig's label, the things that decide what each shard measures."""
    text = json.dumps({"profile": profile.as_dict(), "rig": rig.label,
                       "cases": [c.as_dict() for c in cases]}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class SweepRecord:
    """env.json's ``sweep``: which sweep a run folder measured, and which shard of it."""

    id: str
    """``sweep_id`` of the whole sweep (every shard of it records the same)."""
    cases: int
    """Cases in the whole sweep."""
    workloads: int
    """Workload groups in the whole sweep."""
    shard: Shard | None = None
    """The shard this folder ran; None for the whole sweep."""
    shard_case_ids: tuple[str, ...] = ()
    """The shard's cases in sweep order (empty for the whole sweep)."""

    def as_dict(self) -> dict[str, Any]:
        shard = None if self.shard is None else {
            "index": self.shard.index, "count": self.shard.count,
            "case_ids": list(self.shard_case_ids)}
        return {"id": self.id, "cases": self.cases, "workloads": self.workloads,
                "shard": shard}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SweepRecord:
        shard = d.get("shard")
        return cls(d["id"], d["cases"], d["workloads"],
                   Shard(shard["index"], shard["count"]) if shard else None,
                   tuple(shard["case_ids"]) if shard else ())

    @classmethod
    def of_env(cls, env: dict[str, Any]) -> SweepRecord | None:
        """The record of a run folder's env.json; None for a folder written before shards."""
        d = env.get("sweep")
        return cls.from_dict(d) if isinstance(d, dict) else None


def record(profile: Profile, rig: Rig, cases: Sequence[Case],
           shard: Shard | None = None) -> tuple[SweepRecord, ShardPlan | None]:
    """The record of the whole sweep ``cases`` or of one shard of it, and the shard plan."""
    ident = sweep_id(profile, rig, cases)
    groups = len(workload_groups(cases))
    if shard is None:
        return SweepRecord(ident, len(cases), groups), None
    cut = cut_shards(cases, rig, shard.count)
    return SweepRecord(ident, len(cases), groups, shard, cut.case_ids[shard.index - 1]), cut


def select(cases: Sequence[Case], sweep: SweepRecord) -> list[Case]:
    """The cases of ``sweep``'s shard, in the given order (all of them when unsharded)."""
    if sweep.shard is None:
        return list(cases)
    keep = set(sweep.shard_case_ids)
    return [c for c in cases if c.case_id in keep]


def describe(sweep: SweepRecord, cut: ShardPlan | None = None) -> str:
    """One line for a plan or a progress header, e.g. ``shard 1/2 of sweep 3f2a..: 7 of 14
    cases, 2 of 4 workloads (estimates: 1/2 ~3.1 min, 2/2 ~3.0 min)``."""
    if sweep.shard is None:
        return f"sweep {sweep.id}: {sweep.cases} cases, {sweep.workloads} workloads"
    line = (f"shard {sweep.shard.label} of sweep {sweep.id}: {len(sweep.shard_case_ids)} of "
            f"{sweep.cases} cases")
    if cut is not None:
        k = sweep.shard.index - 1
        each = ", ".join(f"{i + 1}/{sweep.shard.count} ~{format_duration(s)}"
                         for i, s in enumerate(cut.seconds))
        line += f", {cut.workloads[k]} of {sweep.workloads} workloads (estimates: {each})"
    return line
