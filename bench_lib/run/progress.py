"""Progress of a sweep: a tqdm bar on a terminal, plain lines elsewhere: one per launch as
it ends, one per case as its row is written (after its workload's last round).

The ETA starts from the run's estimate (``prediction.duration.run_estimate``: the cases' launches
and the workloads' calibrations still to come) and is corrected by the measured pace (actual
over estimated seconds of the launches and calibrations done so far).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from tqdm import tqdm

from bench_lib.launch.protocol import CaseOutcome
from bench_lib.prediction.duration import format_duration
from bench_lib.sweep.cases import Case


def _interval(row: Mapping[str, Any], low: str, high: str, fmt: str) -> str:
    """`` [a, b]`` from two row columns, or nothing where the row has no interval."""
    a, b = row.get(low), row.get(high)
    if a is None or b is None or a == "" or b == "" or math.isnan(float(b)):
        return ""
    return f" [{float(a):{fmt}}, {float(b):{fmt}}]"


class Progress:
    """Reports each launch and case as they start and end; silent when ``quiet``."""

    def __init__(self, estimates_s: list[float], quiet: bool = False,
                 stream: TextIO | None = None, launches: list[int] | None = None,
                 calibration_s: float = 0.0, calibrations: int = 0) -> None:
        """``estimates_s``: each case's estimated seconds, all its launches;
        ``launches``: each case's launch count (default 1 each); ``calibration_s``: the
        estimated seconds of the sweep's ``calibrations`` (workloads calibrated before
        their cases, ``calibrated`` as each ends)."""
        self.estimates_s = estimates_s
        self.calibration_left_s = calibration_s if calibrations else 0.0
        self.calibrations_left = calibrations
        self.calibration_done_s = 0.0
        """Estimated seconds of the calibrations done: their wall time is in the pace."""
        self.launches = launches or [1] * len(estimates_s)
        self.total = len(estimates_s)
        self.quiet = quiet
        self.stream = stream or sys.stderr
        self.start = time.monotonic()
        self.done_estimate_s = 0.0
        self.dropped_estimate_s = 0.0
        """Estimates of launches that will not run (a case stops after a failed launch)."""
        self.launches_done = [0] * len(estimates_s)
        self.cases_done = 0
        self.bar = None
        if not quiet and self.stream.isatty():
            self.bar = tqdm(total=self.total, unit="case", file=self.stream, dynamic_ncols=True,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}] {postfix}")

    def eta_s(self) -> float:
        """Seconds left: the estimates of launches not yet done, scaled by the pace so far."""
        remaining = max(0.0, sum(self.estimates_s) - self.done_estimate_s
                        - self.dropped_estimate_s) + self.calibration_left_s
        elapsed = time.monotonic() - self.start
        done = self.done_estimate_s + self.calibration_done_s
        pace = elapsed / done if done > 0 else 1.0
        return remaining * pace

    def calibrated(self) -> None:
        """A workload's calibration ended: its share of the estimate is done."""
        if self.calibrations_left:
            share = self.calibration_left_s / self.calibrations_left
            self.calibration_left_s -= share
            self.calibration_done_s += share
            self.calibrations_left -= 1

    def _line(self, text: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def header(self, text: str) -> None:
        self._line(text)

    def note(self, text: str) -> None:
        """A line between the launches' (a calibration's result, say)."""
        self._line(text)

    def _of(self, index: int, launch: int) -> str:
        return f"launch {launch + 1}/{self.launches[index]}"

    def _drop_unrun(self, index: int) -> None:
        unrun = self.launches[index] - self.launches_done[index]
        self.dropped_estimate_s += self.estimates_s[index] * unrun / self.launches[index]
        self.launches_done[index] = self.launches[index]

    def launch_start(self, index: int, case: Case, launch: int) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"{case.describe()} {self._of(index, launch)} | "
                                     f"ETA ~{format_duration(self.eta_s())}")

    def launch_done(self, index: int, case: Case, launch: int, outcome: CaseOutcome) -> None:
        self.done_estimate_s += self.estimates_s[index] / self.launches[index]
        self.launches_done[index] += 1
        if outcome.status != "ok":  # the runner launches a failed case no more
            self._drop_unrun(index)
        if outcome.status == "ok" and outcome.step_times_s:
            times = sorted(outcome.step_times_s)
            detail = f"median {times[len(times) // 2]:.3f} s/step over {len(times)} steps"
        else:
            detail = f"{outcome.status}: {outcome.reason}"
        self._line(f"  {case.describe()} {self._of(index, launch)}: {detail} | "
                   f"ETA ~{format_duration(self.eta_s())}")

    def case_done(self, index: int, case: Case, row: Mapping[str, Any]) -> None:
        self._drop_unrun(index)
        self.cases_done += 1
        if row["status"] == "ok":
            step = _interval(row, "step_time_s_ci_low", "step_time_s_ci_high", ".3f")
            detail = (f"{row['step_time_s_median']:.3f}{step} s/step, "
                      f"{row['throughput_img_s']:.1f} img/s")
            if row.get("speedup_vs_single") not in (None, "") and case.strategy != "single":
                speed = _interval(row, "speedup_ci_low", "speedup_ci_high", ".2f")
                detail += f", {row['speedup_vs_single']:.2f}x{speed} vs single"
            if row.get("per_image_efficiency") not in (None, ""):
                eff = _interval(row, "per_image_efficiency_ci_low",
                                "per_image_efficiency_ci_high", ".0%")
                detail += (f", per image {row['per_image_efficiency']:.0%}{eff} of batch "
                           f"{case.curve_of}'s speed")
        else:
            detail = row["reason"]
        self._line(f"[{self.cases_done}/{self.total}] {case.describe()}: {row['status']} "
                   f"({detail})")
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self._line(f"done in {format_duration(time.monotonic() - self.start)}")
