"""Where a run's wall time went: timed steps, warm-up, and fixed cost (the duty cycle).

    duty cycle 61% of 674 s: timed steps 411 s; warm-up 148 s (22%); fixed 115 s (17%:
    per launch 86 s over 78 launches, per run 29 s)

The duty cycle is the share of the run's wall time spent in timed steps (each launch's
timed steps, the slowest rank's per step, as the case's figures are): the part of the
user's wait that buys a measurement. The rest is warm-up (discarded steps, each launch's
slowest rank's) and fixed cost: per launch, a launch's wall time beyond its steps (process
start, model build, process group, the traced and compute-only steps after the timed ones,
teardown); per run, the rest (planning, idle power, the FLOP peak, the collectives, the
workloads' calibrations, the fork server's start, writing rows). Written as ``duty.json``
in the run folder and printed at the end of the run. Never imports torch.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench_lib.results.store import write_json_atomic

DUTY_FILE = "duty.json"


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
    """The workloads' calibrations (``run.calibrate``): part of the per-run fixed cost."""

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

    def __add__(self, other: DutyCycle) -> DutyCycle:
        """Two sittings of one run (``--resume``)."""
        return DutyCycle(self.wall_s + other.wall_s, self.timed_s + other.timed_s,
                         self.warmup_s + other.warmup_s,
                         self.launches_wall_s + other.launches_wall_s,
                         self.launches + other.launches,
                         self.calibration_s + other.calibration_s)

    def as_dict(self) -> dict[str, Any]:
        """The file's content: the measured seconds, then the derived ones and shares."""
        return asdict(self) | {
            "fixed_s": self.fixed_s, "fixed_per_launch_s": self.per_launch_s,
            "fixed_per_run_s": self.per_run_s, "duty_cycle": self.duty_cycle,
            "warmup_share": self.share(self.warmup_s), "fixed_share": self.share(self.fixed_s)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DutyCycle:
        return cls(float(d["wall_s"]), float(d["timed_s"]), float(d["warmup_s"]),
                   float(d["launches_wall_s"]), int(d["launches"]),
                   float(d.get("calibration_s") or 0.0))

    def summary(self) -> str:
        """One line for the terminal (module docstring)."""
        return (f"duty cycle {self.duty_cycle:.0%} of {self.wall_s:.0f} s: timed steps "
                f"{self.timed_s:.0f} s; warm-up {self.warmup_s:.0f} s "
                f"({self.share(self.warmup_s):.0%}); fixed {self.fixed_s:.0f} s "
                f"({self.share(self.fixed_s):.0%}: per launch {self.per_launch_s:.0f} s over "
                f"{self.launches} launches, per run {self.per_run_s:.0f} s"
                + (f" of which calibration {self.calibration_s:.0f} s"
                   if self.calibration_s else "") + ")")


class DutyMeter:
    """Counts a run's launches as they end (``add``) against its wall clock, started when
    the meter is made."""

    def __init__(self) -> None:
        self._start = time.monotonic()
        self._timed = self._warmup = self._launches_wall = self._calibration = 0.0
        self._launches = 0

    def add(self, step_times_s: list[float], warmup_time_s: float, wall_time_s: float) -> None:
        """One launch that ended: its timed steps, warm-up time and wall time."""
        self._timed += sum(step_times_s)
        self._warmup += warmup_time_s
        self._launches_wall += wall_time_s
        self._launches += 1

    def add_calibration(self, seconds: float) -> None:
        """A workload's calibration that ended, its wall time."""
        self._calibration += seconds

    def finish(self) -> DutyCycle:
        return DutyCycle(time.monotonic() - self._start, self._timed, self._warmup,
                         self._launches_wall, self._launches, self._calibration)


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
