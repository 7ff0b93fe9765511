"""The end-of-run headlines the CLI prints: per workload, the best strategy with its 95%
interval, whether it is clear of the runner-up or a tie, its speedup over single with its 95%
interval, and the best split of each pipelined strategy.

    model image batch prec  best img/s [95% CI] vs runner-up              vs single [95% CI]
    ...    64 ...  ddp 41.2 [40.1, 42.0] img/s > pipeline s8 35.0 [34.2, 35.9]
                   (paired 1.18x [1.15, 1.21])                            1.18x [1.12, 1.23]
    ...   128 ...  tie: 1f1b s4 14.9 [14.1, 15.6] img/s ~ ddp 14.6 [14.0, 15.1]
                   (paired 1.02x [0.97, 1.07])                            1.61x [1.49, 1.74]

(each workload on one line, folded here), then the best split of each pipelined strategy
(``pipeline 8, 1f1b 4``), and what the brackets mean.

Every case of a workload is measured in the same rounds of fresh launches (schema 5), so two
cases compare round by round: the runner-up's launch median over the best's in each round,
with the 95% t interval of those ratios across rounds (``Best.paired``). Drift that slows a
whole round cancels in the ratio, so this decides clear-vs-tie more sharply than setting the
two cases' own intervals side by side, which is the rule left for cases with one launch.

The comparison (``rank``, ``Best``) is shared with the report's headlines and its winner
grid. Plain rows (dicts as the runner wrote them to cases.csv, or a DataFrame's records):
no pandas, no matplotlib, no torch (the column parser is ``results.schema``'s).
"""

from __future__ import annotations

import math
import textwrap
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from bench_lib.analysis.stats import MIN_LAUNCHES_FOR_CI, LaunchInterval, paired_ratio_interval
from bench_lib.results.read import number, provisional_words
from bench_lib.results.schema import launch_medians as schema_launch_medians

Interval = tuple[float, float]
"""A (low, high) pair: a 95% interval, of a throughput in img/s or of a ratio."""

OPTION_TAGS = (("channels_last", "cl"), ("compile", "compile"), ("sync_bn", "syncbn"))
"""Option columns that make a strategy-variant of their own, and their tag in its label."""

NOTE_WIDTH = 100
TIE_RULE = ("'>': the best is clear of the runner-up (the best case of another "
            "strategy-variant); 'tie': not clear. 'paired': the runner-up's launch median "
            "over the best's, round by round (every case of a workload runs once per round, so "
            "drift that slows a round cancels), its geometric mean and 95% t interval across "
            "rounds; 'tie' when that interval holds 1. With 1 launch: 'tie' when the two "
            "cases' intervals overlap.")


def _launch_words(launches: Iterable[int] = (), unit: str = "launches") -> str:
    """``3 launches``, ``2-3 launches``, or ``its launches`` where the counts are unknown."""
    counts = sorted({n for n in launches if n >= MIN_LAUNCHES_FOR_CI})
    if not counts:
        return f"its {unit}"
    span = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"{span} {unit}"


def interval_note(launches: Iterable[int] = ()) -> str:
    """What the brackets beside a throughput are and how a tie is decided; ``launches``: the
    launch counts of the cases shown (their intervals' sizes), where known."""
    return (f"[low, high] beside a throughput: the 95% t interval across {_launch_words(launches)} "
            "of the median step time (geometric mean of the launch medians), as img/s; none "
            "with 1 launch. " + TIE_RULE)


def speedup_note(launches: Iterable[int] = (), weak: bool = False) -> str:
    """What the brackets beside a speedup over single are (``weak``: and what a weak-scaling
    line's speedup is)."""
    return ("vs single [low, high]: the speedup, the geometric mean over rounds of single's "
            "launch median over the case's in the same round, and its 95% t interval across "
            f"{_launch_words(launches, 'rounds')} (pairing by round cancels drift); none with 1 "
            "launch." + (" weak: each device gets the batch (the case's batch is it times its "
                         "devices), the speedup is throughput over single's at the batch."
                         if weak else ""))


INTERVAL_NOTE = interval_note()
SPEEDUP_NOTE = speedup_note()


def _flag(value: Any) -> bool:
    """An option column set to 1 (cases.csv's 0/1; missing reads as not set)."""
    return number(value) == 1.0


def _label(row: Mapping[str, Any]) -> str:
    """Strategy name plus what distinguishes its variants (partition, options set)."""
    partition = row.get("partition")
    if isinstance(partition, float) and math.isnan(partition):  # a DataFrame's missing value
        partition = None
    part = str(partition or "").split(":")[0]  # "balanced:9" -> "balanced"
    options = "".join(f"+{tag}" for col, tag in OPTION_TAGS if _flag(row.get(col)))
    return (str(row["strategy"]) + (f"[{part}]" if part not in ("", "tutorial") else "")
            + options + ddp_tags(row))


def ddp_tags(row: Mapping[str, Any]) -> str:
    """The DDP knobs set away from torch's defaults, as tags: ``+bucket100+gradview+fp16``
    (empty for other strategies and for torch's defaults, so older runs read the same)."""
    cap = row.get("ddp_bucket_cap_mb")
    tags = [f"bucket{cap}" if isinstance(cap, str) and cap not in ("", "default")
            else f"bucket{cap:g}" if isinstance(cap, float) and not math.isnan(cap) else "",
            "gradview" if _flag(row.get("ddp_gradient_as_bucket_view")) else "",
            "static" if _flag(row.get("ddp_static_graph")) else ""]
    hook = row.get("ddp_comm_hook")
    if isinstance(hook, str) and hook not in ("", "none"):
        tags.append(hook)
    return "".join(f"+{t}" for t in tags if t)


def case_name(row: Mapping[str, Any]) -> str:
    """The strategy-variant and its split: ``1f1b[balanced] s8``, ``ddp``."""
    split = number(row.get("split_size"))
    return _label(row) + (f" s{split:g}" if split is not None else "")


def throughput(row: Mapping[str, Any]) -> float | None:
    """The row's throughput in img/s, None where it has none."""
    return number(row.get("throughput_img_s"))


def throughput_interval(row: Mapping[str, Any]) -> Interval | None:
    """The 95% interval of the row's throughput: the batch over the interval of the median
    step time (a t interval across launches; ``step_time_s_ci_high`` gives the low end);
    None where it has none (1 launch)."""
    batch = number(row.get("batch_size"))
    low, high = number(row.get("step_time_s_ci_low")), number(row.get("step_time_s_ci_high"))
    if batch is None or low is None or high is None or not 0 < low <= high or batch <= 0:
        return None
    return batch / high, batch / low


def launch_medians(value: Any) -> list[float]:
    """cases.csv's ``launch_medians_s`` (``0.451;0.447;0.462``, round order) as numbers; []
    where missing or unreadable. One launch's may come as a number (pandas reads ``0.451`` as
    a float). ``results.schema.launch_medians``, forgiving a number or an unreadable cell."""
    if isinstance(value, (int, float)):
        x = number(value)
        return [] if x is None else [x]
    try:
        return schema_launch_medians(value)
    except ValueError:
        return []


def _interval_text(interval: Interval | None) -> str:
    return "" if interval is None else f" [{interval[0]:.1f}, {interval[1]:.1f}]"


def _same_run(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """False only where both rows name their run and the runs differ (rounds pair within a
    run)."""
    runs = [r.get("run_label", r.get("run_id")) for r in (a, b)]
    return None in runs or runs[0] == runs[1]


def paired_ratio(numerator: Mapping[str, Any],
                 denominator: Mapping[str, Any]) -> LaunchInterval | None:
    """``numerator``'s time per image over ``denominator``'s, round by round (their launch
    medians paired by round, over the batch), with the 95% t interval across rounds
    (``analysis.stats.paired_ratio_interval``). Where one ran fewer launches, its rounds are
    the first ones (the runner launches a case in rounds 0..L-1). None under 2 paired rounds,
    or for rows of different runs."""
    a, b = launch_medians(numerator.get("launch_medians_s")), \
        launch_medians(denominator.get("launch_medians_s"))
    batch_a, batch_b = number(numerator.get("batch_size")), number(denominator.get("batch_size"))
    rounds = min(len(a), len(b))
    if rounds < MIN_LAUNCHES_FOR_CI or not _same_run(numerator, denominator) \
            or batch_a is None or batch_b is None or batch_a <= 0 or batch_b <= 0:
        return None
    a, b = a[:rounds], b[:rounds]
    if not all(math.isfinite(v) and v > 0 for v in a + b):
        return None
    return paired_ratio_interval([v / batch_a for v in a], [v / batch_b for v in b])


def _ratio_text(ratio: LaunchInterval) -> str:
    return f" (paired {ratio.point:.2f}x [{ratio.low:.2f}, {ratio.high:.2f}])"


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
    others = [r for r in ok if _label(r) != _label(best)]
    return Best(best, max(others, key=lambda r: throughput(r) or 0.0) if others else None)


def is_curve_point(row: Mapping[str, Any]) -> bool:
    """Whether a row is a point of single's batch curve (``batch_curve_of`` set), not a
    case the sweep compares: it has its own figure, and no place among the strategies."""
    return number(row.get("batch_curve_of")) is not None


def _is_single(row: Mapping[str, Any]) -> bool:
    return row.get("strategy") == "single"


def is_weak(row: Mapping[str, Any]) -> bool:
    """Whether a row is a weak-scaling case (``scaling``: each device gets the workload's
    batch); a row of a run before the column is strong."""
    return row.get("scaling") == "weak"


def workload_batch(row: Mapping[str, Any]) -> float | None:
    """The batch of the row's workload: its own, or under weak scaling each device's."""
    batch, world = number(row.get("batch_size")), number(row.get("world_size"))
    if is_weak(row) and batch is not None and world:
        return batch / world
    return batch


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
        groups[key] = [r for r in groups.get((*key[:-1], "strong"), []) if _is_single(r)] \
            + groups[key]
    return dict(groups)


def speedup(row: Mapping[str, Any], single: Mapping[str, Any] | None = None) -> float | None:
    """The row's speedup over single: its ``speedup_vs_single`` (paired by round), else its
    throughput over ``single``'s; None without either."""
    value = number(row.get("speedup_vs_single"))
    if value is not None:
        return value
    if single is None:
        return None
    mine, theirs = throughput(row), throughput(single)
    return None if mine is None or not theirs else mine / theirs


def speedup_interval(row: Mapping[str, Any]) -> Interval | None:
    """The 95% interval of the row's speedup over single (``speedup_ci_low``, ``_high``: a t
    interval across rounds); None where it has none (1 launch) or the row is single itself."""
    low, high = number(row.get("speedup_ci_low")), number(row.get("speedup_ci_high"))
    if _is_single(row) or low is None or high is None or not 0 < low <= high:
        return None
    return low, high


def speedup_text(value: float | None, interval: Interval | None) -> str:
    """``1.25x [1.15, 1.36]``, ``1.25x`` without an interval, ``n/a`` without a speedup."""
    if value is None:
        return "n/a"
    return f"{value:.2f}x" + ("" if interval is None else
                              f" [{interval[0]:.2f}, {interval[1]:.2f}]")


def _launches(row: Mapping[str, Any]) -> int:
    """The row's launch count: ``launches``, else its launch medians'."""
    n = number(row.get("launches"))
    return int(n) if n is not None else len(launch_medians(row.get("launch_medians_s")))


def _best_splits(ok: list[Mapping[str, Any]]) -> str:
    """``pipeline 8, 1f1b 4``: the fastest split of each pipelined strategy."""
    best: dict[str, Mapping[str, Any]] = {}
    for r in ok:
        if number(r.get("split_size")) is None or throughput(r) is None:
            continue
        key = _label(r)
        if key not in best or (throughput(r) or 0.0) > (throughput(best[key]) or 0.0):
            best[key] = r
    return ", ".join(f"{k} {number(r['split_size']):g}" for k, r in sorted(best.items())) or "-"


def headline_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The headlines as aligned text lines: a header, one line per workload, then what the
    brackets mean (where any were shown) and the failures."""
    groups = headline_groups(rows)
    weak = any(key[-1] == "weak" for key in groups)
    table = [["model", "image", "batch", "prec", *(["scaling"] if weak else []),
              "best img/s [95% CI] vs runner-up", "vs single [95% CI]",
              "best split per pipelined strategy"]]
    shown: list[int] = []  # launch counts of the cases whose intervals are shown
    speedups: list[int] = []  # and of those whose speedup has one
    for (model, image, batch, precision, scaling), group in sorted(
            groups.items(), key=lambda kv: group_order(kv[0])):
        head = [str(model), str(image), str(batch), str(precision),
                *([scaling] if weak else [])]
        found = rank(group)
        if found is None:
            statuses = sorted({str(r["status"]) for r in group})
            table.append([*head, f"no case ran ({', '.join(statuses)})"])
            continue
        best = found.best
        single = next((r for r in group if _is_single(r) and r["status"] == "ok"
                       and throughput(r) is not None), None)
        value = speedup(best, single)
        interval = speedup_interval(best) if value is not None else None
        shown += [_launches(r) for r in (best, found.runner_up) if r is not None
                  and (throughput_interval(r) is not None or found.rule == "paired")]
        speedups += [_launches(best)] if interval is not None else []
        table.append([*head, found.text(), speedup_text(value, interval),
                      _best_splits([r for r in group if r["status"] == "ok"])])
    # A workload where no case ran is a short row: its message does not widen the columns.
    widths = [max(len(row[i]) for row in table if len(row) == len(table[0]))
              for i in range(len(table[0]))]
    right = {1, 2}  # image and batch read as numbers
    keys = 5 if weak else 4  # the workload's cells, then the figures

    def aligned(row: list[str]) -> str:
        cells = [c.rjust(widths[i]) if i in right else
                 (c if i == len(row) - 1 else c.ljust(widths[i])) for i, c in enumerate(row)]
        return " ".join(cells[:keys]) + ("  " + "  ".join(cells[keys:])
                                         if len(cells) > keys else "")

    lines = [aligned(row).rstrip() for row in table]
    lines += textwrap.wrap(interval_note(shown), NOTE_WIDTH) if shown else []
    lines += textwrap.wrap(speedup_note(speedups, weak), NOTE_WIDTH) if speedups else []
    failed = [r for r in rows if r["status"] in ("error", "timeout", "oom")]
    if failed:
        lines.append(f"{len(failed)} case(s) failed: "
                     + "; ".join(f"{r['case_id']} {r['status']}" for r in failed[:5])
                     + (" ..." if len(failed) > 5 else ""))
    # A workload's rows before its last round (cases.csv provisional): figures to be sharpened.
    so_far = provisional_words(r.get("provisional") for r in rows)
    return lines + (textwrap.wrap(so_far[:1].upper() + so_far[1:] + ".", NOTE_WIDTH)
                    if so_far else [])


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
