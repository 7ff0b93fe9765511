"""What a run says on stderr as it goes: a workload's answer after each of its rounds, and
the whole run's at its end (the headlines, the answer in words, the prediction's score, the
duty cycle), made from the rows so far."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench_lib.run.cells import Row
    from bench_lib.run.duty import DutyCycle
    from bench_lib.run.workload_rows import RoundDone
    from bench_lib.sweep.profile import Profile


def answer_text(rows: Sequence[Row], profile: Profile) -> list[str]:
    """The headlines, the answer in words and the prediction's score of ``rows``: the
    run's at its end, a workload's after each of its rounds (``round_answer``)."""
    from bench_lib.report.answer import answer_lines
    from bench_lib.report.headlines import NOTE_WIDTH as ANSWER_WIDTH
    from bench_lib.report.headlines import headline_lines, tutorial_lines
    from bench_lib.report.part_errors import part_error_lines
    from bench_lib.report.time_prediction import score_lines

    rows = list(rows)
    lines = headline_lines(rows)
    if profile.name == "tutorial":
        lines += tutorial_lines(rows)
    return lines + [line for answer in answer_lines(rows) + score_lines(rows)
                    + part_error_lines(rows) for line in textwrap.wrap(answer, ANSWER_WIDTH)]


def round_answer(done: RoundDone, profile: Profile) -> list[str]:
    """A workload's answer after one of its rounds: ``answer_text`` of its rows so far
    (provisional before its last round: the headlines say so), under a line naming the
    round."""
    head = (f"workload {done.workload} of {done.workloads}, after round {done.round_done} "
            f"of {done.rounds}" + (" (final):" if done.final else ":"))
    return [head, *(f"  {line}" for line in answer_text(done.rows, profile))]


def print_answers(rows: list[Row], profile: Profile, cycle: DutyCycle, run_dir: Path) -> None:
    """After the sweep, on stderr: the headlines, the answer in words, the prediction's
    score, the duty cycle and where the results are."""
    for line in answer_text(rows, profile):
        print(line, file=sys.stderr)
    print(cycle.text(), file=sys.stderr)
    print(f"results: {run_dir / 'cases.csv'}", file=sys.stderr)
