"""The end-of-run headlines the CLI prints: per workload, the best strategy with its 95%
interval, whether it is clear of the runner-up or a tie, its speedup over single with a rough
range, and the best split of each pipelined strategy.

    (model, image, batch, precision)  best img/s [95% CI] vs runner-up      vs single [rough range]
    ... 64 ...  ddp 41.2 [40.1, 42.0] img/s > pipeline s8 35.0 [34.2, 35.9]  1.18x [1.12, 1.23]
    ... 128 ... tie: 1f1b s4 14.9 [14.1, 15.6] img/s ~ ddp 14.6 [14.0, 15.1]  1.61x [1.49, 1.74]

then the best split of each pipelined strategy (``pipeline 8, 1f1b 4``), and what the brackets
mean.

The comparison (``rank``, ``Best``) is shared with the report's headlines and its winner
grid. Plain rows (dicts as the runner wrote them to cases.csv, or a DataFrame's records):
no pandas, no matplotlib.
"""

from __future__ import annotations

import math
import textwrap
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Interval = tuple[float, float]
"""A (low, high) pair: here the 95% interval of a case's throughput in img/s."""

OPTION_TAGS = (("channels_last", "cl"), ("compile", "compile"), ("sync_bn", "syncbn"))
"""Option columns that make a strategy-variant of their own, and their tag in its label."""

INTERVAL_NOTE = ("[low, high] beside a throughput: the 95% interval of the median step time "
                 "(bootstrap, within the run), as img/s. '>': the best is clear of the "
                 "runner-up (the best case of another strategy-variant); 'tie': their "
                 "intervals overlap.")
NOTE_WIDTH = 100
RANGE_RULE = ("a rough range from the two medians' intervals (the best's low over single's "
              "high, its high over single's low), not a confidence interval of the speedup: "
              "that comes with replicated launches.")
RANGE_NOTE = f"vs single [low, high]: {RANGE_RULE}"


def _number(value: Any) -> float | None:
    """A finite float, or None for a missing value (None, "", NaN, a word)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _flag(value: Any) -> bool:
    """An option column set to 1 (cases.csv's 0/1; missing reads as not set)."""
    return _number(value) == 1.0


def _label(row: Mapping[str, Any]) -> str:
    """Strategy name plus what distinguishes its variants (partition, options set)."""
    partition = row.get("partition")
    if isinstance(partition, float) and math.isnan(partition):  # a DataFrame's missing value
        partition = None
    part = str(partition or "").split(":")[0]  # "balanced:9" -> "balanced"
    options = "".join(f"+{tag}" for col, tag in OPTION_TAGS if _flag(row.get(col)))
    return (str(row["strategy"]) + (f"[{part}]" if part not in ("", "tutorial") else "")
            + options)


def case_name(row: Mapping[str, Any]) -> str:
    """The strategy-variant and its split: ``1f1b[balanced] s8``, ``ddp``."""
    split = _number(row.get("split_size"))
    return _label(row) + (f" s{split:g}" if split is not None else "")


def throughput(row: Mapping[str, Any]) -> float | None:
    """The row's throughput in img/s, None where it has none."""
    return _number(row.get("throughput_img_s"))


def throughput_interval(row: Mapping[str, Any]) -> Interval | None:
    """The 95% interval of the row's throughput: the batch over the bootstrap interval of the
    median step time (``step_time_s_ci_high`` gives the low end); None where it has none."""
    batch = _number(row.get("batch_size"))
    low, high = _number(row.get("step_time_s_ci_low")), _number(row.get("step_time_s_ci_high"))
    if batch is None or low is None or high is None or not 0 < low <= high or batch <= 0:
        return None
    return batch / high, batch / low


def _interval_text(interval: Interval | None) -> str:
    return "" if interval is None else f" [{interval[0]:.1f}, {interval[1]:.1f}]"


@dataclass(frozen=True)
class Best:
    """A workload's best ok case set against its runner-up: the best ok case of another
    strategy-variant (``_label``: strategy, partition, options; its splits are one variant)."""

    best: Mapping[str, Any]
    runner_up: Mapping[str, Any] | None

    @property
    def interval(self) -> Interval | None:
        return throughput_interval(self.best)

    @property
    def runner_up_interval(self) -> Interval | None:
        return None if self.runner_up is None else throughput_interval(self.runner_up)

    @property
    def verdict(self) -> str:
        """``winner`` (intervals apart), ``tie`` (they overlap), ``no interval`` (one is
        missing: no winner claimed) or ``alone`` (no other strategy-variant ran)."""
        if self.runner_up is None:
            return "alone"
        mine, theirs = self.interval, self.runner_up_interval
        if mine is None or theirs is None:
            return "no interval"
        return "tie" if max(mine[0], theirs[0]) <= min(mine[1], theirs[1]) else "winner"

    def describe(self, unit: str = "img/s") -> tuple[str, str]:
        """(lead, rest) in words: the lead is the best's name, ``tie:`` or ``best (no
        interval):``; e.g. ``("tie:", "ddp 53.6 [51.0, 55.9] img/s ~ 1f1b[balanced] s8 52.1
        [49.8, 54.0]")``."""
        name = case_name(self.best)
        figures = f"{throughput(self.best) or 0.0:.1f}{_interval_text(self.interval)} {unit}"
        if self.runner_up is None:
            return name, f"{figures} (the only strategy that ran)"
        other = (f"{case_name(self.runner_up)} {throughput(self.runner_up) or 0.0:.1f}"
                 f"{_interval_text(self.runner_up_interval)}")
        verdict = self.verdict
        if verdict == "winner":
            return name, f"{figures} > {other}"
        if verdict == "tie":
            return "tie:", f"{name} {figures} ~ {other}"
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
    others = [r for r in ok if _label(r) != _label(best)]
    return Best(best, max(others, key=lambda r: throughput(r) or 0.0) if others else None)


def speedup_range(best: Mapping[str, Any], single: Mapping[str, Any]) -> Interval | None:
    """A rough range of the best's speedup over single: its throughput interval's ends over
    single's opposite ends. Not a confidence interval of the speedup (the two medians'
    intervals, combined at their extremes); None without both intervals, or when the best is
    single itself."""
    if best is single or best.get("case_id") == single.get("case_id"):
        return None
    mine, theirs = throughput_interval(best), throughput_interval(single)
    if mine is None or theirs is None:
        return None
    return mine[0] / theirs[1], mine[1] / theirs[0]


def speedup_text(speedup: float | None, rough: Interval | None) -> str:
    """``1.25x [1.15, 1.36]``, ``1.25x`` without a range, ``n/a`` without a speedup."""
    if speedup is None:
        return "n/a"
    return f"{speedup:.2f}x" + ("" if rough is None else f" [{rough[0]:.2f}, {rough[1]:.2f}]")


def _best_splits(ok: list[dict[str, Any]]) -> str:
    """``pipeline 8, 1f1b 4``: the fastest split of each pipelined strategy."""
    best: dict[str, dict[str, Any]] = {}
    for r in ok:
        if _number(r.get("split_size")) is None or throughput(r) is None:
            continue
        key = _label(r)
        if key not in best or (throughput(r) or 0.0) > (throughput(best[key]) or 0.0):
            best[key] = r
    return ", ".join(f"{k} {_number(r['split_size']):g}" for k, r in sorted(best.items())) or "-"


def headline_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The headlines as aligned text lines: a header, one line per workload, then what the
    brackets mean (where any were shown) and the failures."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["model"], r["image_size"], r["batch_size"], r["precision"])].append(r)
    table = [["model", "image", "batch", "prec", "best img/s [95% CI] vs runner-up",
              "vs single [rough range]", "best split per pipelined strategy"]]
    intervals = ranges = False
    for (model, image, batch, precision), group in sorted(groups.items()):
        head = [str(model), str(image), str(batch), str(precision)]
        found = rank(group)
        if found is None:
            statuses = sorted({str(r["status"]) for r in group})
            table.append([*head, f"no case ran ({', '.join(statuses)})"])
            continue
        best = found.best
        single = next((r for r in group if r["strategy"] == "single" and r["status"] == "ok"
                       and throughput(r) is not None), None)
        speedup = rough = None
        if single is not None:
            speedup = (throughput(best) or 0.0) / (throughput(single) or 1.0)
            rough = speedup_range(best, single)
        intervals |= found.interval is not None or found.runner_up_interval is not None
        ranges |= rough is not None
        table.append([*head, found.text(), speedup_text(speedup, rough),
                      _best_splits([r for r in group if r["status"] == "ok"])])
    # A workload where no case ran is a short row: its message does not widen the columns.
    widths = [max(len(row[i]) for row in table if len(row) == len(table[0]))
              for i in range(len(table[0]))]
    right = {1, 2}  # image and batch read as numbers

    def aligned(row: list[str]) -> str:
        cells = [c.rjust(widths[i]) if i in right else
                 (c if i == len(row) - 1 else c.ljust(widths[i])) for i, c in enumerate(row)]
        return " ".join(cells[:4]) + ("  " + "  ".join(cells[4:]) if len(cells) > 4 else "")

    lines = [aligned(row).rstrip() for row in table]
    lines += textwrap.wrap(INTERVAL_NOTE, NOTE_WIDTH) if intervals else []
    lines += textwrap.wrap(RANGE_NOTE, NOTE_WIDTH) if ranges else []
    failed = [r for r in rows if r["status"] in ("error", "timeout", "oom")]
    if failed:
        lines.append(f"{len(failed)} case(s) failed: "
                     + "; ".join(f"{r['case_id']} {r['status']}" for r in failed[:5])
                     + (" ..." if len(failed) > 5 else ""))
    return lines


# The PyTorch model-parallel tutorial's published timings: seconds for 3 training steps of
# ResNet50, batch 120, 128 px, one-hot MSELoss, on its (unnamed) 2-GPU machine.
TUTORIAL_PUBLISHED_S: dict[tuple[str, int | str], float] = {
    ("single", ""): 3.75, ("mp", ""): 4.02, ("pipeline", 20): 2.51, ("pipeline", 12): 2.43}


def tutorial_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Set the tutorial's published numbers beside this run's, for 3 steps as it reports."""
    lines = []
    for (strategy, split), published in TUTORIAL_PUBLISHED_S.items():
        match = [r for r in rows if r["strategy"] == strategy and r["status"] == "ok"
                 and r["batch_size"] == 120 and r["image_size"] == 128
                 and str(r.get("split_size", "")) == str(split)]
        name = strategy + (f" split {split}" if split else "")
        yours = f"{3 * match[0]['step_time_s_median']:.2f} s" if match else "not run"
        lines.append(f"  {name:<18} tutorial {published:.2f} s   this machine {yours}")
    return ["3 steps of batch 120 at 128 px, tutorial (2 GPUs) vs this machine:", *lines]
