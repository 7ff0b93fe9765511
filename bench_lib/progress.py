"""Progress of a sweep on the terminal: one line per case, to stderr."""

from __future__ import annotations

import sys
import time

from bench_lib.sweep import Case


class Progress:
    """Reports each case as it starts and ends; silent when ``quiet``."""

    def __init__(self, total: int, quiet: bool = False) -> None:
        self.total = total
        self.quiet = quiet
        self.start = time.monotonic()

    def _print(self, text: str) -> None:
        if not self.quiet:
            print(text, file=sys.stderr, flush=True)

    def header(self, text: str) -> None:
        self._print(text)

    def case_start(self, index: int, case: Case) -> None:
        if case.status is None:
            self._print(f"[{index + 1}/{self.total}] {case.describe()} ...")

    def case_done(self, index: int, case: Case, row: dict) -> None:
        elapsed = time.monotonic() - self.start
        if row["status"] == "ok":
            detail = (f"{row['step_time_s_median']:.3f} s/step, "
                      f"{row['throughput_img_s']:.1f} img/s")
        else:
            detail = row["reason"]
        self._print(f"[{index + 1}/{self.total}] {case.describe()}: {row['status']} "
                    f"({detail}) [{elapsed:.0f} s elapsed]")

    def close(self) -> None:
        self._print(f"done in {time.monotonic() - self.start:.0f} s")
