"""The test suite cut into shards that each get their own cores, and what a shard's JUnit
report says (pure: no process started here; ``testsuite`` starts them).

A shard is one pytest process pinned to ``CORES_PER_SHARD`` cores, so the suite's cpu rigs
see the 2-core machine they are written for and do not fight over cores. Tests are weighed
by their markers (``collect_plugin``), files whole where they fit, and dealt heaviest first
to the lightest shard (longest-processing-time first), so the slow files spread::

    16 cores -> 8 shards: cores 0,1 | 2,3 | ... | 14,15
    a file heavier than a shard's share is cut into its test functions, a function heavier
    still into its cases
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

CORES_PER_SHARD = 2
WEIGHTS_S = {"slow": 30.0, "gpu": 15.0, "integration": 4.0, "unit": 0.1, "skip": 0.0}
"""A test's rough seconds by its kind (``collect_plugin.kind_of``): only their ratios
matter, to spread the heavy files."""
GPU_SKIP = "needs a CUDA GPU"
"""The start of the reason conftest skips a GPU test with where torch sees no GPU."""


@dataclass(frozen=True)
class PytestShard:
    """One pytest process: its cores and the test ids (files, functions or cases) it runs."""

    index: int
    cores: tuple[int, ...]
    tests: tuple[str, ...]
    weight_s: float

    def describe(self) -> str:
        return f"shard {self.index} (cores {','.join(map(str, self.cores))})"


def core_groups(cores: Sequence[int], per_shard: int = CORES_PER_SHARD) -> list[tuple[int, ...]]:
    """``cores`` in groups of ``per_shard`` (at least one group; an odd core left over joins
    the last group rather than idle)."""
    cores = sorted(cores)
    count = max(1, len(cores) // per_shard)
    groups = [tuple(cores[i * per_shard:(i + 1) * per_shard]) for i in range(count - 1)]
    return [*groups, tuple(cores[(count - 1) * per_shard:])]


def _file(test: str) -> str:
    return test.split("::", 1)[0]


def _function(test: str) -> str:
    return test.split("[", 1)[0]


def _case(test: str) -> str:
    return test


LEVELS: tuple[Callable[[str], str], ...] = (_file, _function, _case)


def units(kinds: Mapping[str, str], limit_s: float,
          levels: Sequence[Callable[[str], str]] = LEVELS) -> dict[str, float]:
    """Test id -> weight: each file whole, unless it weighs more than ``limit_s``: then its
    functions, and a function heavier still its cases (only where a case's id cannot be
    misread on pytest's command line: no ``::`` inside its parameters)."""
    grouped: dict[str, list[str]] = {}
    for test in kinds:
        grouped.setdefault(levels[0](test), []).append(test)
    out: dict[str, float] = {}
    for unit, members in grouped.items():
        weight = sum(WEIGHTS_S[kinds[t]] for t in members)
        finer = levels[1:]
        if finer and finer[0] is _case and any("::" in t.split("[", 1)[-1] for t in members
                                              if "[" in t):
            finer = ()
        if weight > limit_s and finer:
            out |= units({t: kinds[t] for t in members}, limit_s, finer)
        else:
            out[unit] = weight
    return out


def deal_shards(kinds: Mapping[str, str], cores: Sequence[int],
         per_shard: int = CORES_PER_SHARD) -> list[PytestShard]:
    """The shards for ``cores`` (``core_groups``) with the tests of ``kinds`` dealt heaviest
    first to the lightest shard; a shard with nothing to run is left out."""
    groups = core_groups(cores, per_shard)
    total = sum(WEIGHTS_S[k] for k in kinds.values())
    dealt = units(kinds, total / len(groups))
    loads = [0.0] * len(groups)
    members: list[list[str]] = [[] for _ in groups]
    for unit, weight in sorted(dealt.items(), key=lambda kv: (-kv[1], kv[0])):
        lightest = min(range(len(groups)), key=lambda i: (loads[i], i))
        loads[lightest] += weight
        members[lightest].append(unit)
    return [PytestShard(i, groups[i], tuple(sorted(members[i])), loads[i])
            for i in range(len(groups)) if members[i]]


@dataclass(frozen=True)
class ShardResult:
    """What one shard's pytest did."""

    shard: PytestShard
    returncode: int | None
    """pytest's exit code; None where it was stopped at the time limit."""
    wall_s: float
    log: Path
    passed: int = 0
    skipped: int = 0
    failed: tuple[str, ...] = ()
    """Test ids that failed or errored (collection errors included)."""
    gpu_skipped: int = 0
    """GPU tests skipped because torch saw no GPU."""
    problem: str = ""
    """Why the shard's result cannot be read as a whole run (stopped, crashed, no report)."""

    def counts_line(self) -> str:
        """``1 failed, 201 passed, 3 skipped in 153 s`` (and its problem)."""
        parts = [f"{len(self.failed)} failed"] if self.failed else []
        parts += [f"{self.passed} passed"] + ([f"{self.skipped} skipped"] if self.skipped else [])
        text = ", ".join(parts) + f" in {self.wall_s:.0f} s"
        return f"{text}; {self.problem}" if self.problem else text


def node_id(classname: str, name: str, files: set[str]) -> str:
    """A JUnit test case's pytest id: ``tests.test_x.TestY`` + ``test_z[a]`` ->
    ``tests/test_x.py::TestY::test_z[a]``; the module is the longest prefix that is one
    of ``files``. A collection error has no classname: its name is the module."""
    parts = classname.split(".") if classname else name.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if path in files:
            rest = parts[cut:] + ([name] if classname else [])
            return "::".join([path, *rest])
    return f"{classname}::{name}" if classname else name


def read_junit(report: Path, files: set[str]) -> tuple[int, int, tuple[str, ...], int]:
    """(passed, skipped, failed ids, GPU tests skipped for want of a GPU) of a JUnit XML
    report that pytest's ``--junitxml`` wrote."""
    passed = skipped = gpu_skipped = 0
    failed: list[str] = []
    for case in ET.parse(report).getroot().iter("testcase"):
        tags = {child.tag: child for child in case}
        if "failure" in tags or "error" in tags:
            failed.append(node_id(case.get("classname", ""), case.get("name", ""), files))
        elif "skipped" in tags:
            skipped += 1
            gpu_skipped += GPU_SKIP in (tags["skipped"].get("message") or "")
        else:
            passed += 1
    return passed, skipped, tuple(dict.fromkeys(failed)), gpu_skipped
