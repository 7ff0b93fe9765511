"""The values the report reads off one cases.csv row: a case's name (``case_name``, from its
strategy-variant's ``label`` and its ``ddp_tags``), its throughput and its speedup over single
with their 95% intervals, its launch medians and the ratio of two rows' times paired by round
(``paired_ratio``), and what kind of row it is (``is_single``, ``is_weak``,
``is_curve_point``, ``workload_batch``).

Plain rows (dicts as the runner wrote them to cases.csv, or a DataFrame's records): no
pandas, no matplotlib, no torch (the column parser is ``results.schema``'s).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from bench_lib.analysis.stats import MIN_LAUNCHES_FOR_CI, LaunchInterval, paired_ratio_interval
from bench_lib.results.read import number
from bench_lib.results.schema import launch_medians as schema_launch_medians

Interval = tuple[float, float]
"""A (low, high) pair: a 95% interval, of a throughput in img/s or of a ratio."""

OPTION_TAGS = (("channels_last", "cl"), ("compile", "compile"), ("sync_bn", "syncbn"))
"""Option columns that make a strategy-variant of their own, and their tag in its label."""


def _flag(value: Any) -> bool:
    """An option column set to 1 (cases.csv's 0/1; missing reads as not set)."""
    return number(value) == 1.0


def label(row: Mapping[str, Any]) -> str:
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
    return label(row) + (f" s{split:g}" if split is not None else "")


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


def is_curve_point(row: Mapping[str, Any]) -> bool:
    """Whether a row is a point of single's batch curve (``batch_curve_of`` set), not a
    case the sweep compares: it has its own figure, and no place among the strategies."""
    return number(row.get("batch_curve_of")) is not None


def is_single(row: Mapping[str, Any]) -> bool:
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
    if is_single(row) or low is None or high is None or not 0 < low <= high:
        return None
    return low, high
