"""The gate's rounds: in each, each side runs the sweep once (``run --launches 1``).

* **Together** (where both sides can, ``bench_lib.TAKES_TURNS``, and ``--apart`` is not
  given): both sides' sweeps at once, each case's ranks taking turns step by step with
  the other side's on the same devices (``bench_lib.turns``): each pair of steps
  meets the machine in the same second. In the first round the head starts once the base's
  first rank waits for it, so that each side calibrates its first workload alone (a
  profile's later workloads are calibrated on both sides at once in that round: the ``ci``
  profile has one).
* **Apart**: base then head in even rounds and head then base in odd ones (B H | H B | B H
  | ...: ABBA), so that a linear drift, and a co-runner that lasts about a round, hit both
  sides alike.

A side's later rounds reuse the calibration (and the collectives) its first round measured."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench_lib.gate.sides import SIDES, Progress, SideRun, run_side, say_on_stderr, start_side
from bench_lib.results.schema import CALIBRATION_FILE
from bench_lib.turns import TURNS_DIR_ENV, TURNS_SIDE_ENV

FIRST_ARRIVAL_TIMEOUT_S = 600.0
"""How long the first round waits for the base's first rank to reach its turns before
starting the head anyway (a base that calibrates for longer than this is unheard of)."""


def sides_order(round_index: int) -> tuple[str, str]:
    """The sides in the order round ``round_index`` runs them: base first in even rounds,
    head first in odd ones (B H | H B | ...: ABBA over each pair of rounds)."""
    return SIDES if round_index % 2 == 0 else (SIDES[1], SIDES[0])


def measure(envs: Mapping[str, Mapping[str, str]], gate_dir: Path, work: Path, *,
            profile: str, rounds: int, run_args: Sequence[str], python: str,
            say: Progress = say_on_stderr, together: bool = False,
            ) -> tuple[dict[str, list[Path]], list[dict[str, Any]]]:
    """Run both sides (checked out under ``work``) in rounds: at once taking turns where
    ``together``, else one after the other (``sides_order``); each side's run folders in
    round order and a record of every run (side, round, seconds)."""
    runs: dict[str, list[Path]] = {name: [] for name in envs}
    record: list[dict[str, Any]] = []
    started, total = time.monotonic(), rounds if together else 2 * rounds

    def args_for(name: str) -> list[str]:
        reuse = reusable_calibration(runs[name][0]) if runs[name] else None
        return [*run_args, *(["--calibration", str(reuse)] if reuse else [])]

    def done(r: int, name: str, run: Path, seconds: float) -> None:
        runs[name].append(run)
        record.append({"side": name, "round": r + 1, "seconds": round(seconds, 1),
                       "run": str(run.relative_to(gate_dir))})

    def eta(finished: int) -> str:
        left = (time.monotonic() - started) / finished * (total - finished)
        return f" | ETA ~{left:.0f} s" if finished < total else ""

    for r in range(rounds):
        if together:
            seconds = _round_together(r, envs, gate_dir, work, profile, python, args_for,
                                      done)
            say(f"  round {r + 1}/{rounds}, both sides taking turns: "
                f"{max(seconds.values()):.0f} s{eta(r + 1)}")
            continue
        for name in sides_order(r):
            t0 = time.monotonic()
            run = run_side(work / name, envs[name], python, gate_dir / name / f"round-{r + 1}",
                           profile, args_for(name))
            seconds_apart = time.monotonic() - t0
            done(r, name, run, seconds_apart)
            say(f"  round {r + 1}/{rounds} {name}: {seconds_apart:.0f} s{eta(len(record))}")
    return runs, record


def _round_together(r: int, envs: Mapping[str, Mapping[str, str]], gate_dir: Path,
                    work: Path, profile: str, python: str,
                    args_for: Callable[[str], list[str]],
                    done: Callable[[int, str, Path, float], None]) -> dict[str, float]:
    """Round ``r`` with both sides at once, taking turns (``bench_lib.turns``) through a
    folder of the round's own; each side's seconds. In the first round the head starts once
    the base's first rank waits at its turns (or the base has ended): each side then
    calibrates its first workload alone."""
    folder = Path(tempfile.mkdtemp(prefix="pb-turns-"))  # short: a socket path's limit
    started: dict[str, tuple[SideRun, float]] = {}
    try:
        for name in SIDES:
            env = {**envs[name], TURNS_DIR_ENV: str(folder), TURNS_SIDE_ENV: name}
            started[name] = (start_side(work / name, env, python,
                                        gate_dir / name / f"round-{r + 1}", profile,
                                        args_for(name)), time.monotonic())
            if name == "base" and r == 0:
                _wait_for_a_rank(folder, started[name][0])
        seconds = {}
        for name in SIDES:
            side, t0 = started[name]
            run = side.finish()
            seconds[name] = time.monotonic() - t0
            done(r, name, run, seconds[name])
        return seconds
    except BaseException:
        for side, _ in started.values():
            side.stop()
        raise
    finally:
        for leftover in folder.iterdir():
            leftover.unlink(missing_ok=True)
        folder.rmdir()


def _wait_for_a_rank(folder: Path, side: SideRun,
                     timeout_s: float = FIRST_ARRIVAL_TIMEOUT_S) -> None:
    """Until a rank of ``side`` waits at its turns in ``folder`` (its meeting point is
    there), ``side`` has ended, or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while (not any(folder.iterdir()) and side.proc.poll() is None
           and time.monotonic() < deadline):
        time.sleep(0.1)


def reusable_calibration(run_dir: Path) -> Path | None:
    """The step-time calibration a side's first round measured, for its later rounds to
    reuse (``run --calibration``, with the collectives it keeps): seconds a round saved, and
    every round predicted from the same figures, so that the rounds' errors differ by the
    measurement alone. None where that side does not predict (its profile's
    ``predict_time`` off) or predates ``--calibration`` (its calibration.json names no
    hardware)."""
    path = run_dir / CALIBRATION_FILE
    try:
        return path if json.loads(path.read_text()).get("hardware") else None
    except (OSError, ValueError, AttributeError):
        return None
