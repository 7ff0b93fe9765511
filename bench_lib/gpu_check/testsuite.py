"""The test suite run with the GPU visible, in shards that each have their own cores
(``shards.deal_shards``): one collection, then every shard at once, each with its log and JUnit
report, a line as each ends, and a summary file."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench_lib.gpu_check.shards import PytestShard, ShardResult, deal_shards, read_junit

PYTEST = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:randomly",
          "-p", "no:cacheprovider"]
"""pytest with no worker processes of its own (a shard is one process on its cores), in
file order, and no shared cache folder for the shards to race on."""
COLLECT_TIMEOUT_S = 180
SHARD_TIMEOUT_S = 420
"""A shard's limit: on a 16-core H100 box the evidence's shards took 58 to 344 s."""
HEARTBEAT_S = 60


@dataclass(frozen=True)
class Collection:
    """Every test the suite collects, with its kind (``collect_plugin.kind_of``), and the
    files pytest could not collect."""

    kinds: dict[str, str]
    errors: tuple[str, ...] = ()
    problem: str = ""
    """Why no test could be listed (then ``kinds`` is empty)."""

    @property
    def files(self) -> set[str]:
        return {test.split("::", 1)[0] for test in self.kinds} | set(self.errors)


def collect(repo: Path, out: Path) -> Collection:
    """One ``--collect-only`` of the suite in ``repo`` (with the GPU visible, as the
    shards will see it), its kinds written to ``out``/test-kinds.json."""
    kinds_file = out / "test-kinds.json"
    command = [*PYTEST, "--collect-only", "-q", "-p", "bench_lib.gpu_check.collect_plugin",
               f"--test-kinds-out={kinds_file}"]
    try:
        proc = subprocess.run(command, cwd=repo, capture_output=True, text=True,
                              timeout=COLLECT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Collection({}, problem=f"collecting the tests took over {COLLECT_TIMEOUT_S} s")
    # `ERROR tests/test_x.py - ImportError: ...` in pytest's short summary.
    errors = tuple(dict.fromkeys(m.group(1) for m in
                                 re.finditer(r"^ERROR (\S+)", proc.stdout, re.MULTILINE)))
    if not kinds_file.is_file():
        tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
        return Collection({}, errors, f"pytest listed no tests (exit {proc.returncode}): {tail}")
    return Collection(json.loads(kinds_file.read_text()), errors)


def shard_command(shard: PytestShard, report: Path) -> list[str]:
    """The pytest command of ``shard``, its JUnit report written to ``report``."""
    return [*PYTEST, "-v", f"--junitxml={report}", *shard.tests]


def _start(shard: PytestShard, out: Path, repo: Path) -> subprocess.Popen[bytes]:
    log = (out / f"shard{shard.index}.log").open("wb")
    cores = set(shard.cores)
    # Pinned before exec, so every thread and child it starts stays on its cores; its own
    # session, so that a shard over its time is stopped with every process it started.
    with log:
        return subprocess.Popen(shard_command(shard, out / f"shard{shard.index}.xml"),
                                cwd=repo, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT,
                                start_new_session=True,
                                preexec_fn=lambda: os.sched_setaffinity(0, cores))


def _result(shard: PytestShard, out: Path, code: int | None, wall_s: float,
            files: set[str]) -> ShardResult:
    log, report = out / f"shard{shard.index}.log", out / f"shard{shard.index}.xml"
    stopped = f"stopped at its time limit after {wall_s:.0f} s" if code is None else ""
    if not report.is_file():
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-2:])
        why = stopped or f"pytest exited {code} without a report: {tail}"
        return ShardResult(shard, code, wall_s, log, problem=why)
    passed, skipped, failed, gpu_skipped = read_junit(report, files)
    problem = stopped or ("" if code in (0, 1) else f"pytest exited {code}")
    return ShardResult(shard, code, wall_s, log, passed, skipped, failed, gpu_skipped, problem)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a shard's pytest and every process it started (its session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass
    proc.wait()


def run_shards(shards: Sequence[PytestShard], collection: Collection, repo: Path, out: Path,
               timeout_s: float = SHARD_TIMEOUT_S,
               say: Callable[[str], None] = print) -> list[ShardResult]:
    """Run every shard at once; a line as each ends and every ``HEARTBEAT_S``; a shard over
    ``timeout_s`` is stopped (its result says so)."""
    start = time.monotonic()
    running = {s.index: (s, _start(s, out, repo)) for s in shards}
    results: dict[int, ShardResult] = {}
    beat = start
    try:
        while running:
            time.sleep(0.5)
            now = time.monotonic()
            for index, (shard, proc) in list(running.items()):
                code = proc.poll()
                if code is None and now - start <= timeout_s:
                    continue
                if code is None:
                    _stop(proc)
                del running[index]
                results[index] = _result(shard, out, code, now - start, collection.files)
                say(f"  {shard.describe()}: {results[index].counts_line()}")
            if running and now - beat >= HEARTBEAT_S:
                beat = now
                say(f"  tests: {len(results)} of {len(shards)} shards done after "
                    f"{now - start:.0f} s")
    finally:  # interrupted (Ctrl-C): no shard left running on the box
        for _, proc in running.values():
            _stop(proc)
    return [results[s.index] for s in shards]


def write_summary(results: Sequence[ShardResult], out: Path) -> Path:
    """``out``/summary.txt: each shard's cores, tests, outcome and wall time."""
    lines = []
    for r in results:
        lines += [f"== {r.shard.describe()}: {' '.join(r.shard.tests)}",
                  f"{r.counts_line()} (exit {r.returncode}, log {r.log.name})",
                  *(f"FAILED {t}" for t in r.failed)]
    path = out / "summary.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_suite(repo: Path, out: Path, cores: Sequence[int], per_shard: int,
              timeout_s: float = SHARD_TIMEOUT_S,
              say: Callable[[str], None] = print) -> tuple[list[ShardResult], tuple[str, ...]]:
    """Collect the suite, plan its shards on ``cores``, run them; their results and the
    collection's problems. ``out`` receives the logs, reports and summary.txt."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("shard*.xml"), *out.glob("shard*.log"), out / "test-kinds.json"]:
        stale.unlink(missing_ok=True)  # an earlier check's report must not be read as this one's
    say("\ntests: collecting ...")
    collection = collect(repo, out)
    problems = [f"{e}: pytest could not collect it" for e in collection.errors]
    if not collection.kinds:
        return [], (collection.problem or "no test collected", *problems)
    shards = deal_shards(collection.kinds, cores, per_shard)
    say(f"tests: {len(collection.kinds)} tests in {len(shards)} shards of {per_shard} cores "
        f"each, up to {timeout_s:.0f} s; logs in {out}")
    results = run_shards(shards, collection, repo, out, timeout_s, say)
    say(f"tests: summary in {write_summary(results, out)}")
    return results, tuple(problems)
