"""The answer in words: per workload, which strategy is fastest and what keeps the others
behind, each sentence built from the run's own numbers (no number, no sentence).

    64 px, batch 16: single is fastest (49.3 [44.2, 55.1] img/s). The other strategies
    lose most to the smaller batch per device (a median 36% of their step): 8 images per
    device (ddp's) run at 44% [38%, 52%] of batch 16's per-image speed on this rig. With
    16 images per device (weak scaling), ddp gains most: 1.62x [1.50, 1.75] single's
    throughput on 2 devices (81% scaling efficiency).

The winner and its interval are the headlines' (``ranking.rank``) under strong scaling
(the batch split over the devices); the loss is the waterfall part
(``bench_lib.rows.waterfall``) with the largest median share of the other ok cases'
steps, or the remainder (what no part explains) where that share is larger; the batch
curve's point is the per-device batch of the fastest of them that cuts the batch (``dp``'s
replicas cut it too: ``Case.device_batch_size``), and that case is named. The weak-scaling
sentence names the weak case with the largest speedup over single (a throughput ratio,
paired by round) and says whether its interval clears 1. A last
sentence, only where some case's launches differ by more than their steps' noise explains
(``launches_differ``, ``analysis.launch_spread``), names those cases.

What a run says on stderr as it goes is made here too (``answer_text``): a workload's
answer after each of its rounds (``round_answer``), and the whole run's at its end (the
headlines, the answer in words, the prediction's score), from the rows so far.
"""

from __future__ import annotations

import statistics
import textwrap
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from bench_lib.report.headlines import NOTE_WIDTH, headline_lines, tutorial_lines
from bench_lib.report.part_errors import part_error_lines
from bench_lib.report.ranking import group_order, headline_groups, rank
from bench_lib.report.row_values import (
    case_name,
    is_curve_point,
    is_weak,
    speedup_interval,
    throughput,
    throughput_interval,
)
from bench_lib.report.time_prediction import score_lines
from bench_lib.results.read import number

LOSSES = {"batch": "the smaller batch per device",
          "optimizer": "each device's optimizer step beyond its share",
          "corun": "computing side by side (each device slower beside the others)",
          "imbalance": "the busiest device's extra work",
          "bubble": "the schedule's bubble", "comm": "communication not hidden",
          "own": "the strategies' own work: DDP's bucketing, FSDP2's copies, a schedule's "
                 "hand-offs"}
"""The waterfall's losses, in words, in ``analysis.step_parts.PARTS`` order (a tie goes to
the first); the ideal and the remainder are not losses of a kind."""
UNEXPLAINED_PCT = 10.0
"""A median remainder beyond this share of the step is said."""
MEASURABLE_PCT = 0.5
"""A median share below this rounds to 0%: never named as a loss."""


def _range(low: float | None, high: float | None, fmt: str) -> str:
    return "" if low is None or high is None else f" [{low:{fmt}}, {high:{fmt}}]"


def _winner(group: list[Mapping[str, Any]], image: Any, batch: Any) -> str | None:
    found = rank(group)
    if found is None:
        return None
    best, head = found.best, f"{image} px, batch {batch}: "
    if found.verdict == "tie" and found.runner_up is not None:
        paired = found.paired
        ratio = "" if paired is None else (
            f" (the runner-up's time over the best's {paired.point:.2f}x"
            f"{_range(paired.low, paired.high, '.2f')})")
        return f"{head}{case_name(best)} and {case_name(found.runner_up)} tie{ratio}."
    low, high = throughput_interval(best) or (None, None)
    speed = f"{throughput(best) or 0.0:.1f}{_range(low, high, '.1f')} img/s"
    versus = ""
    if best.get("strategy") != "single" and number(best.get("speedup_vs_single")):
        low, high = speedup_interval(best) or (None, None)
        versus = f", {float(best['speedup_vs_single']):.2f}x{_range(low, high, '.2f')} single"
    return f"{head}{case_name(best)} is fastest ({speed}{versus})."


def _curve_point(curve: list[Mapping[str, Any]], device_batch: int) -> Mapping[str, Any] | None:
    return next((r for r in curve if number(r.get("batch_size")) == device_batch
                 and number(r.get("per_image_efficiency")) is not None), None)


def _loss(group: list[Mapping[str, Any]], curve: list[Mapping[str, Any]],
          batch: Any) -> str | None:
    others = [r for r in group if r.get("status") == "ok" and r.get("strategy") != "single"
              and number(r.get("waterfall_ideal_pct")) is not None]
    if not others:
        return None
    medians = {part: statistics.median(number(r.get(f"waterfall_{part}_pct")) or 0.0
                                       for r in others) for part in (*LOSSES, "remainder")}
    part = max(LOSSES, key=lambda p: medians[p])
    remainder = medians["remainder"]
    if remainder > medians[part] and remainder >= MEASURABLE_PCT:
        # What nothing explains is the largest share: naming a smaller part as the main loss
        # would send the reader to the wrong place.
        named = (f"; the largest part is {LOSSES[part]} (a median {medians[part]:.0f}%)"
                 if medians[part] >= MEASURABLE_PCT else ": each part's median is under 1%")
        return (f"The other strategies lose most to what no part explains (a median "
                f"{remainder:.0f}% of their step){named}.")
    if medians[part] < MEASURABLE_PCT:
        text = "No part costs the other strategies a median 1% of their step or more."
    else:
        text = (f"The other strategies lose most to {LOSSES[part]} (a median "
                f"{medians[part]:.0f}% of their step){_batch_point(others, curve, batch, part)}.")
    if abs(remainder) > UNEXPLAINED_PCT:
        text += f" A median {remainder:.0f}% of their step is not explained by any part."
    return text


def _batch_point(others: list[Mapping[str, Any]], curve: list[Mapping[str, Any]], batch: Any,
                 part: str) -> str:
    """Where the main loss is the batch: the batch curve's point at the per-device batch of
    the fastest case that cuts the batch (empty otherwise, or without that point)."""
    if part != "batch":
        return ""
    cutting = sorted((r for r in others if number(r.get("device_batch_size"))
                      not in (None, number(batch))), key=lambda r: -(throughput(r) or 0))
    point = (_curve_point(curve, int(number(cutting[0]["device_batch_size"]) or 0))
             if cutting else None)
    if point is None:
        return ""
    eff = float(point["per_image_efficiency"])
    low = number(point.get("per_image_efficiency_ci_low"))
    high = number(point.get("per_image_efficiency_ci_high"))
    return (f": {int(float(point['batch_size']))} images per device ({case_name(cutting[0])}'s) "
            f"run at {eff:.0%}{_range(low, high, '.0%')} of batch {batch}'s per-image speed "
            "on this rig")


def _weak(group: list[Mapping[str, Any]], batch: Any) -> str | None:
    """The weak-scaling sentence: the weak case with the largest speedup over single."""
    weak = [r for r in group if is_weak(r) and r.get("status") == "ok"
            and number(r.get("speedup_vs_single")) is not None]
    if not weak:
        return None
    best = max(weak, key=lambda r: float(r["speedup_vs_single"]))
    value = float(best["speedup_vs_single"])
    interval = speedup_interval(best)
    devices = int(number(best.get("world_size")) or 1)
    low, high = interval or (None, None)
    figures = (f"{value:.2f}x{_range(low, high, '.2f')} single's throughput "
               f"on {devices} devices ({value / devices:.0%} scaling efficiency)")
    head = f"With {batch} images per device (weak scaling), "
    if interval is None:
        return f"{head}{case_name(best)} gains most: {figures}, with no interval (1 launch)."
    if interval[0] > 1:
        return f"{head}{case_name(best)} gains most: {figures}."
    if interval[1] < 1:
        return f"{head}no strategy beats single: the best, {case_name(best)}, reaches {figures}."
    return f"{head}the best, {case_name(best)}, reaches {figures}: not clear of single."


def _launches(group: list[Mapping[str, Any]]) -> str | None:
    """The cases whose launches differ beyond their steps' noise, in one sentence; None
    where none does."""
    flagged = list(dict.fromkeys(case_name(r) for r in group
                                 if number(r.get("launches_differ")) == 1))
    if not flagged:
        return None
    names = ", ".join(flagged)
    verb = "differ" if len(flagged) == 1 else "differ, case by case,"
    return (f"The launches of {names} {verb} more than their steps' noise explains "
            "(launch_note): the intervals, which resample launches, carry that spread.")


def answer_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One short paragraph per workload (module docstring), in workload order."""
    groups = headline_groups(rows, by_run=True)
    curves: dict[tuple[Any, ...], list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        if is_curve_point(r):
            curves[(r.get("run_label", ""), r["model"], r["image_size"],
                    int(float(r["batch_curve_of"])), r["precision"])].append(r)
    lines = []
    for key in sorted((k for k in groups if k[-1] == "strong"), key=group_order):
        workload = key[:-1]
        _, _, image, batch, _ = workload
        weak = groups.get((*workload, "weak"), [])
        sentences = [s for s in (_winner(groups[key], image, batch),
                                 _loss(groups[key], curves.get(workload, []), batch),
                                 _weak(weak, batch),
                                 _launches(groups[key] + [r for r in weak if is_weak(r)])) if s]
        if sentences:
            lines.append(" ".join(sentences))
    return lines


def answer_text(rows: Sequence[dict[str, Any]], profile_name: str) -> list[str]:
    """The headlines, the answer in words and the prediction's score of ``rows``: the
    run's at its end, a workload's after each of its rounds (``round_answer``); the
    tutorial profile's timings beside them."""
    rows = list(rows)
    lines = headline_lines(rows)
    if profile_name == "tutorial":
        lines += tutorial_lines(rows)
    return lines + [line for answer in answer_lines(rows) + score_lines(rows)
                    + part_error_lines(rows) for line in textwrap.wrap(answer, NOTE_WIDTH)]


def round_answer(label: str, rows: Sequence[dict[str, Any]], profile_name: str
                 ) -> list[str]:
    """A workload's answer after one of its rounds: ``answer_text`` of its rows so far
    (provisional before its last round: the headlines say so), under ``label``, the line
    naming the round (``RoundDone.label``)."""
    return [label, *(f"  {line}" for line in answer_text(rows, profile_name))]
