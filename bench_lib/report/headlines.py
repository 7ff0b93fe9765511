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

The ranking is ``ranking``'s (``rank``, ``Best``: paired by round where both cases ran 2 or
more launches), the values ``row_values``'. What the brackets mean (``interval_note``,
``speedup_note``) is the report page's words too. ``tutorial_lines`` sets the PyTorch
model-parallel tutorial's published timings beside this machine's. Plain rows: no pandas, no
matplotlib, no torch.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Mapping
from typing import Any

from bench_lib.analysis.stats import MIN_LAUNCHES_FOR_CI
from bench_lib.report.ranking import group_order, headline_groups, rank
from bench_lib.report.row_values import (
    Interval,
    is_single,
    label,
    launch_medians,
    speedup,
    speedup_interval,
    throughput,
    throughput_interval,
)
from bench_lib.results.read import number, provisional_words

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
        key = label(r)
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
        single = next((r for r in group if is_single(r) and r["status"] == "ok"
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
