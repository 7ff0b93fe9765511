"""The gate's rounds: in each, each side runs the sweep once (``run --launches 1``), base
then head in even rounds and head then base in odd ones (B H | H B | B H | ...: ABBA), so
that a linear drift, and a co-runner that lasts about a round, hit both sides alike. A
side's later rounds reuse the calibration (and the collectives) its first round measured."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench_lib.gate.sides import SIDES, Progress, run_side, say_on_stderr
from bench_lib.results.schema import CALIBRATION_FILE


def sides_order(round_index: int) -> tuple[str, str]:
    """The sides in the order round ``round_index`` runs them: base first in even rounds,
    head first in odd ones (B H | H B | ...: ABBA over each pair of rounds)."""
    return SIDES if round_index % 2 == 0 else (SIDES[1], SIDES[0])


def measure(envs: Mapping[str, Mapping[str, str]], gate_dir: Path, work: Path, *,
            profile: str, rounds: int, run_args: Sequence[str], python: str,
            say: Progress = say_on_stderr) -> tuple[dict[str, list[Path]], list[dict[str, Any]]]:
    """Run both sides (checked out under ``work``) in rounds (``sides_order``); each
    side's run folders in round order and a record of every run (side, round, seconds)."""
    runs: dict[str, list[Path]] = {name: [] for name in envs}
    record: list[dict[str, Any]] = []
    started, total = time.monotonic(), 2 * rounds
    for r in range(rounds):
        for name in sides_order(r):
            t0 = time.monotonic()
            reuse = reusable_calibration(runs[name][0]) if runs[name] else None
            args = [*run_args, *(["--calibration", str(reuse)] if reuse else [])]
            run = run_side(work / name, envs[name], python, gate_dir / name / f"round-{r + 1}",
                           profile, args)
            seconds = time.monotonic() - t0
            runs[name].append(run)
            record.append({"side": name, "round": r + 1, "seconds": round(seconds, 1),
                           "run": str(run.relative_to(gate_dir))})
            elapsed = time.monotonic() - started
            left = elapsed / len(record) * (total - len(record))
            say(f"  round {r + 1}/{rounds} {name}: {seconds:.0f} s"
                + (f" | ETA ~{left:.0f} s" if len(record) < total else ""))
    return runs, record


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
