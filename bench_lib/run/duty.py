"""Where a run's wall time went: timed steps, warm-up, and fixed cost (the duty cycle).

    duty cycle 61% of 674 s: timed steps 411 s; warm-up 148 s (22%); fixed 115 s (17%:
    per launch 86 s over 78 launches, per run 29 s); estimated 640 s, took 674 s (+5%)
      warm-up: first steps 40 s, steady 108 s; per launch 1.10 s: model build 0.41,
      teardown 0.22, diagnostics 0.18, process group 0.12, collect 0.06, ...
      per run 29 s: calibration 12 s, collectives 4 s, flop peak 3 s, idle power 3 s, ...

The duty cycle is the share of the run's wall time spent in timed steps (each launch's
timed steps, the slowest rank's per step, as the case's figures are): the part of the
user's wait that buys a measurement. The rest is warm-up (discarded steps, each launch's
slowest rank's) and fixed cost: per launch, a launch's wall time beyond its steps (process
start, model build, process group, the traced and compute-only steps after the timed ones,
teardown); per run, the rest (planning, the pre-flight, idle power, the FLOP peak, the
collectives, the workloads' calibrations, the fork server's start, writing rows). Both are
broken into named parts that add up to them: a launch's from its ranks' and the runner's stamps
(``launch_parts``), the run's from ``DutyMeter.part`` around each step of the command;
warm-up into its first steps (autotuning, lazy starts) and the steady rest. Written as
``duty.json`` in the run folder and printed at the end of the run. Never imports torch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench_lib.launch.launch_parts import LAUNCH_PARTS
from bench_lib.results.store import write_json_atomic

DUTY_FILE = "duty.json"
SUMMARY_PARTS = 5
"""The biggest parts the end line names, per launch and per run."""


@dataclass(frozen=True)
class DutyCycle:
    """A run's wall time split into timed steps, warm-up and fixed cost, in seconds."""

    wall_s: float
    """From the command's start to the sweep's end (the report after it is not counted)."""
    timed_s: float
    """Every launch's timed steps, the slowest rank's time per step."""
    warmup_s: float
    """Every launch's warm-up steps (the slowest rank's)."""
    launches_wall_s: float
    """Every launch's wall time, from starting its first rank to reaping its last."""
    launches: int
    calibration_s: float = 0.0
    """The workloads' calibrations (``prediction.calibration``): part of the per-run fixed cost."""
    launch_parts_s: dict[str, float] = field(default_factory=dict)
    """The per-launch fixed cost by part, summed over launches (``launch_parts``: they add
    up to ``per_launch_s``); empty: not recorded (a run from before them)."""
    warmup_parts_s: dict[str, float] = field(default_factory=dict)
    """The warm-up split: ``warmup_first_step_s`` (each launch's first warm-up step:
    autotuning, lazy starts, allocator growth) and ``warmup_steady_s``, adding up to
    ``warmup_s``; empty: not recorded."""
    run_parts_s: dict[str, float] = field(default_factory=dict)
    """The per-run fixed cost by part (``DutyMeter.part``, the calibrations, the runner's
    work between launches, ``other_s``: the rest), adding up to ``per_run_s``; empty: not
    recorded."""
    estimate_s: float = 0.0
    """The run's own estimate of its duration, made before it ran (0: none)."""

    @property
    def per_launch_s(self) -> float:
        """Fixed cost inside launches: their wall time beyond their steps."""
        return max(0.0, self.launches_wall_s - self.timed_s - self.warmup_s)

    @property
    def per_run_s(self) -> float:
        """Fixed cost outside launches."""
        return max(0.0, self.wall_s - self.launches_wall_s)

    @property
    def fixed_s(self) -> float:
        return self.per_launch_s + self.per_run_s

    def share(self, seconds: float) -> float:
        """``seconds`` as a share (0-1) of the wall time."""
        return seconds / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def duty_cycle(self) -> float:
        return self.share(self.timed_s)

    @property
    def launch_parts_per_launch_s(self) -> dict[str, float]:
        """Each launch part's mean over the launches."""
        n = self.launches
        return {k: v / n for k, v in self.launch_parts_s.items()} if n else {}

    def __add__(self, other: DutyCycle) -> DutyCycle:
        """Two sittings of one run (``--resume``)."""
        return DutyCycle(self.wall_s + other.wall_s, self.timed_s + other.timed_s,
                         self.warmup_s + other.warmup_s,
                         self.launches_wall_s + other.launches_wall_s,
                         self.launches + other.launches,
                         self.calibration_s + other.calibration_s,
                         _summed(self.launch_parts_s, other.launch_parts_s),
                         _summed(self.warmup_parts_s, other.warmup_parts_s),
                         _summed(self.run_parts_s, other.run_parts_s),
                         self.estimate_s + other.estimate_s)

    def as_dict(self) -> dict[str, Any]:
        """The file's content: the measured seconds, then the derived ones and shares."""
        return asdict(self) | {
            "fixed_s": self.fixed_s, "fixed_per_launch_s": self.per_launch_s,
            "fixed_per_run_s": self.per_run_s, "duty_cycle": self.duty_cycle,
            "warmup_share": self.share(self.warmup_s), "fixed_share": self.share(self.fixed_s),
            "launch_parts_per_launch_s": self.launch_parts_per_launch_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DutyCycle:
        """Read ``as_dict``'s content; a file from before the parts has none."""

        def parts(key: str) -> dict[str, float]:
            return {str(k): float(v) for k, v in (d.get(key) or {}).items()}

        return cls(float(d["wall_s"]), float(d["timed_s"]), float(d["warmup_s"]),
                   float(d["launches_wall_s"]), int(d["launches"]),
                   float(d.get("calibration_s") or 0.0), parts("launch_parts_s"),
                   parts("warmup_parts_s"), parts("run_parts_s"),
                   float(d.get("estimate_s") or 0.0))

    def text(self) -> str:
        """Up to three lines for the terminal (module docstring): the shares, then the
        biggest parts where they were recorded."""
        lines = [
            f"duty cycle {self.duty_cycle:.0%} of {self.wall_s:.0f} s: timed steps "
            f"{self.timed_s:.0f} s; warm-up {self.warmup_s:.0f} s "
            f"({self.share(self.warmup_s):.0%}); fixed {self.fixed_s:.0f} s "
            f"({self.share(self.fixed_s):.0%}: per launch {self.per_launch_s:.0f} s over "
            f"{self.launches} launches, per run {self.per_run_s:.0f} s"
            + (f" of which calibration {self.calibration_s:.0f} s"
               if self.calibration_s else "") + ")" + self._estimate_words()]
        launch = []
        if self.warmup_parts_s:
            launch.append(f"warm-up: first steps "
                          f"{self.warmup_parts_s.get('warmup_first_step_s', 0.0):.0f} s, "
                          f"steady {self.warmup_parts_s.get('warmup_steady_s', 0.0):.0f} s")
        if self.launch_parts_s and self.launches:
            each = self.per_launch_s / self.launches
            launch.append(f"per launch {each:.2f} s: "
                          + _biggest(self.launch_parts_per_launch_s, "{:.2f}"))
        if launch:
            lines.append("  " + "; ".join(launch))
        if self.run_parts_s:
            lines.append(f"  per run {self.per_run_s:.0f} s: "
                         + _biggest(self.run_parts_s, "{:.0f} s"))
        return "\n".join(lines)

    def _estimate_words(self) -> str:
        if not self.estimate_s:
            return ""
        off = (self.wall_s - self.estimate_s) / self.estimate_s
        return f"; estimated {self.estimate_s:.0f} s, took {self.wall_s:.0f} s ({off:+.0%})"


def _summed(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    """Each key's sum over ``a`` and ``b``."""
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in dict.fromkeys([*a, *b])}


def _biggest(parts: Mapping[str, float], unit: str) -> str:
    """The ``SUMMARY_PARTS`` biggest parts, named in words, largest first, then "..."."""
    ranked = sorted(parts.items(), key=lambda kv: -abs(kv[1]))
    words = [f"{k.removesuffix('_s').replace('_', ' ')} {unit.format(v)}"
             for k, v in ranked[:SUMMARY_PARTS]]
    return ", ".join(words + (["..."] if len(ranked) > SUMMARY_PARTS else []))


class DutyMeter:
    """Counts a run's launches as they end (``add``) against its wall clock, started when
    the meter is made."""

    def __init__(self) -> None:
        self._start = time.monotonic()
        self._timed = self._warmup = self._launches_wall = self._calibration = 0.0
        self._warmup_first = self._estimate = 0.0
        self._sweep: float | None = None
        self._launches = 0
        self._launch_parts: dict[str, float] = {}
        self._run_parts: dict[str, float] = {}

    def add(self, step_times_s: list[float], warmup_time_s: float, wall_time_s: float,
            parts_s: Mapping[str, float] | None = None,
            warmup_first_step_s: float = 0.0) -> None:
        """One launch that ended: its timed steps, warm-up time and wall time, its fixed
        cost's parts (``CaseOutcome.parts_s``) and its first warm-up step."""
        self._timed += sum(step_times_s)
        self._warmup += warmup_time_s
        self._warmup_first += warmup_first_step_s
        self._launches_wall += wall_time_s
        self._launches += 1
        self._launch_parts = _summed(self._launch_parts, parts_s or {})

    def add_calibration(self, seconds: float) -> None:
        """A workload's calibration that ended, its wall time."""
        self._calibration += seconds

    def set_estimate(self, seconds: float) -> None:
        """The run's own estimate of its duration, made before it ran."""
        self._estimate = seconds

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Count the block's wall time as the per-run part ``<name>_s`` (added to any
        earlier block of that name), also when it raises."""
        began = time.monotonic()
        try:
            yield
        finally:
            key = f"{name}_s"
            self._run_parts[key] = self._run_parts.get(key, 0.0) + time.monotonic() - began

    @contextmanager
    def sweep(self) -> Iterator[None]:
        """Around the sweep (its launches and calibrations): what else it took is the
        runner's work between launches (``between_launches_s``: admission, predictions,
        rows and files written)."""
        began = time.monotonic()
        try:
            yield
        finally:
            self._sweep = (self._sweep or 0.0) + time.monotonic() - began

    def finish(self) -> DutyCycle:
        """The run so far, its parts completed: ``other_s`` is the per-run rest."""
        wall = time.monotonic() - self._start
        run = dict(self._run_parts) | {"calibration_s": self._calibration}
        if self._sweep is not None:
            run["between_launches_s"] = self._sweep - self._launches_wall - self._calibration
        run["other_s"] = wall - self._launches_wall - sum(run.values())
        warmup = ({"warmup_first_step_s": self._warmup_first,
                   "warmup_steady_s": self._warmup - self._warmup_first}
                  if self._launches else {})
        order = {k: i for i, k in enumerate(LAUNCH_PARTS)}
        launch = dict(sorted(self._launch_parts.items(), key=lambda kv: order.get(kv[0], 99)))
        return DutyCycle(wall, self._timed, self._warmup, self._launches_wall, self._launches,
                         self._calibration, launch, warmup, run, self._estimate)


def write_duty(run_dir: Path, duty: DutyCycle) -> DutyCycle:
    """Write ``duty`` to the run folder, added to what an earlier sitting of the run
    (``--resume``) wrote there; returns what was written."""
    path = run_dir / DUTY_FILE
    try:
        duty = DutyCycle.from_dict(json.loads(path.read_text())) + duty
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no earlier sitting (or from before duty.json): this one alone
    write_json_atomic(path, duty.as_dict())
    return duty
