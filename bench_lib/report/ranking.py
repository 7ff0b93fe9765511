"""Which case of a workload is best, and whether it is clear of the runner-up: the sweep's
rows per workload and scaling (``headline_groups``), and in each the best ok case set against
the best of another strategy-variant (``rank``, ``Best``). The headlines, the answer in
words, the report's headlines and its winner grid all rank this way.

Every case of a workload is measured in the same rounds of fresh launches (schema 5), so two
cases compare round by round: the runner-up's launch median over the best's in each round,
with the 95% t interval of those ratios across rounds (``Best.paired``). Drift that slows a
whole round cancels in the ratio, so this decides clear-vs-tie more sharply than setting the
two cases' own intervals side by side, which is the rule left for cases with one launch.

Plain rows, as ``row_values`` reads them: no pandas, no matplotlib, no torch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from bench_lib.analysis.stats import LaunchInterval
from bench_lib.report.row_values import (
    Interval,
    case_name,
    is_curve_point,
    is_single,
    is_weak,
    label,
    paired_ratio,
    throughput,
    throughput_interval,
    workload_batch,
)
from bench_lib.results.read import number


def _interval_text(interval: Interval | None) -> str:
    return "" if interval is None else f" [{interval[0]:.1f}, {interval[1]:.1f}]"


def _ratio_text(ratio: LaunchInterval) -> str:
    return f" (paired {ratio.point:.2f}x [{ratio.low:.2f}, {ratio.high:.2f}])"


@dataclass(frozen=True)
class Best:
    """A workload's best ok case set against its runner-up: the best ok case of another
    strategy-variant (``label``: strategy, partition, options; its splits are one variant)."""

    best: Mapping[str, Any]
    runner_up: Mapping[str, Any] | None

    @property
    def interval(self) -> Interval | None:
        return throughput_interval(self.best)

    @property
    def runner_up_interval(self) -> Interval | None:
        return None if self.runner_up is None else throughput_interval(self.runner_up)

    @cached_property
    def paired(self) -> LaunchInterval | None:
        """The runner-up's time per image over the best's, round by round (``paired_ratio``):
        above 1 the best is faster. None without a runner-up or 2 paired launches."""
        return None if self.runner_up is None else paired_ratio(self.runner_up, self.best)

    @property
    def rule(self) -> str:
        """How ``verdict`` was decided: ``paired`` (the ratio's interval across rounds),
        ``overlap`` (the two cases' own intervals: a case with 1 launch) or empty (no
        comparison: alone, or an interval missing)."""
        if self.runner_up is None:
            return ""
        if self.paired is not None:
            return "paired"
        return "overlap" if self.interval is not None and self.runner_up_interval is not None \
            else ""

    @property
    def verdict(self) -> str:
        """``winner`` (clear of the runner-up), ``tie``, ``no interval`` (no comparison
        possible: no winner claimed) or ``alone`` (no other strategy-variant ran).

        With 2 or more launches of both, paired by round: ``winner`` when the interval of the
        runner-up's time over the best's lies above 1, else ``tie``. Otherwise (1 launch) by
        the cases' own intervals: ``tie`` when they overlap."""
        if self.runner_up is None:
            return "alone"
        if self.paired is not None:
            return "winner" if self.paired.low > 1.0 else "tie"
        mine, theirs = self.interval, self.runner_up_interval
        if mine is None or theirs is None:
            return "no interval"
        return "tie" if max(mine[0], theirs[0]) <= min(mine[1], theirs[1]) else "winner"

    def describe(self, unit: str = "img/s") -> tuple[str, str]:
        """(lead, rest) in words: the lead is the best's name, ``tie:`` or ``best (no
        interval):``; e.g. ``("tie:", "ddp 53.6 [51.0, 55.9] img/s ~ 1f1b[balanced] s8 52.1
        [49.8, 54.0] (paired 1.03x [0.98, 1.08])")``: the paired ratio where it decided."""
        name = case_name(self.best)
        figures = f"{throughput(self.best) or 0.0:.1f}{_interval_text(self.interval)} {unit}"
        if self.runner_up is None:
            return name, f"{figures} (the only strategy that ran)"
        other = (f"{case_name(self.runner_up)} {throughput(self.runner_up) or 0.0:.1f}"
                 f"{_interval_text(self.runner_up_interval)}")
        ratio = "" if self.paired is None else _ratio_text(self.paired)
        verdict = self.verdict
        if verdict == "winner":
            return name, f"{figures} > {other}{ratio}"
        if verdict == "tie":
            return "tie:", f"{name} {figures} ~ {other}{ratio}"
        lead = "best (no interval):" if self.interval is None else \
            "best (runner-up has no interval):"
        return lead, f"{name} {figures} vs {other}"

    def text(self, unit: str = "img/s") -> str:
        """``describe`` as one line."""
        return " ".join(self.describe(unit))


def rank(rows: Iterable[Mapping[str, Any]]) -> Best | None:
    """The best ok case (largest throughput, the first of equals) and the runner-up: the best
    ok case of another strategy-variant. ``rows`` are one workload's (same model, image size,
    batch, precision; and run, in a report of several). None where no ok case has a
    throughput."""
    ok = [r for r in rows if r.get("status") == "ok" and throughput(r) is not None]
    if not ok:
        return None
    best = max(ok, key=lambda r: throughput(r) or 0.0)
    others = [r for r in ok if label(r) != label(best)]
    return Best(best, max(others, key=lambda r: throughput(r) or 0.0) if others else None)


def group_order(key: tuple[Any, ...]) -> tuple[tuple[int, float, str], ...]:
    """A sort key for ``headline_groups``' keys: numbers as numbers (64 px before 128),
    then text; strong before weak."""
    return tuple((0, n, "") if (n := number(v)) is not None else (1, 0.0, str(v))
                 for v in key)


def headline_groups(rows: Iterable[Mapping[str, Any]], by_run: bool = False
                    ) -> dict[tuple[Any, ...], list[Mapping[str, Any]]]:
    """The sweep's rows (batch-curve points left out) per workload and scaling: keys
    (``run_label`` where ``by_run``,) model, image size, the workload's batch
    (``workload_batch``), precision, ``strong`` or ``weak``. A weak group holds the weak
    cases and the workload's ``single`` rows, the baseline they are compared with; every
    other row is strong."""
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = defaultdict(list)
    rows = [r for r in rows if not is_curve_point(r)]
    for r in rows:
        run = (r.get("run_label", ""),) if by_run else ()
        batch = workload_batch(r)
        key = (*run, r["model"], r["image_size"], int(batch) if batch is not None else batch,
               r["precision"])
        groups[(*key, "weak" if is_weak(r) else "strong")].append(r)
    for key in [k for k in groups if k[-1] == "weak"]:
        groups[key] = [r for r in groups.get((*key[:-1], "strong"), []) if is_single(r)] \
            + groups[key]
    return dict(groups)
