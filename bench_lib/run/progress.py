"""Progress of a sweep: a tqdm bar on a terminal, one plain line per case elsewhere.

The ETA starts from the cases' estimated durations and is corrected by the measured pace
(actual over estimated seconds of the cases done so far).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from tqdm import tqdm

from bench_lib.sweep.cases import Case
from bench_lib.sweep.estimate import format_duration


class Progress:
    """Reports each case as it starts and ends; silent when ``quiet``."""

    def __init__(self, estimates_s: list[float], quiet: bool = False,
                 stream: TextIO | None = None) -> None:
        self.estimates_s = estimates_s
        self.total = len(estimates_s)
        self.quiet = quiet
        self.stream = stream or sys.stderr
        self.start = time.monotonic()
        self.done_estimate_s = 0.0
        self.bar = None
        if not quiet and self.stream.isatty():
            self.bar = tqdm(total=self.total, unit="case", file=self.stream, dynamic_ncols=True,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}] {postfix}")

    def eta_s(self, next_index: int) -> float:
        """Seconds left: remaining estimates scaled by the pace measured so far."""
        remaining = sum(self.estimates_s[next_index:])
        elapsed = time.monotonic() - self.start
        pace = elapsed / self.done_estimate_s if self.done_estimate_s > 0 else 1.0
        return remaining * pace

    def _line(self, text: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def header(self, text: str) -> None:
        self._line(text)

    def case_start(self, index: int, case: Case) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(
                f"{case.describe()} | ETA ~{format_duration(self.eta_s(index))}"
            )

    def case_done(self, index: int, case: Case, row: Mapping[str, Any]) -> None:
        self.done_estimate_s += self.estimates_s[index]
        if row["status"] == "ok":
            detail = (f"{row['step_time_s_median']:.3f} s/step, "
                      f"{row['throughput_img_s']:.1f} img/s")
        else:
            detail = row["reason"]
        eta = format_duration(self.eta_s(index + 1))
        self._line(f"[{index + 1}/{self.total}] {case.describe()}: {row['status']} ({detail})"
                   + (f" | ETA ~{eta}" if index + 1 < self.total else ""))
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self._line(f"done in {format_duration(time.monotonic() - self.start)}")
