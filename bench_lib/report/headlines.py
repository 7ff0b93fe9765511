"""The end-of-run headlines the CLI prints: per workload, the best strategy, its speedup
over single, and the best split of each pipelined strategy.

    image  batch  prec  best        img/s  vs single  best split per pipelined strategy
    64     32     fp32  ddp          41.2      1.02x  pipeline 8, 1f1b 4
    128    32     fp32  1f1b         14.9      1.61x  pipeline 16, 1f1b 4

Plain rows (dicts as the runner wrote them to cases.csv): no pandas, no matplotlib.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any


def _label(row: dict[str, Any]) -> str:
    """Strategy name plus what distinguishes its variants (split size, partition)."""
    part = str(row.get("partition") or "").split(":")[0]  # "balanced:9" -> "balanced"
    return str(row["strategy"]) + (f"[{part}]" if part not in ("", "tutorial") else "")


def _best_splits(ok: list[dict[str, Any]]) -> str:
    """``pipeline 8, 1f1b 4``: the fastest split of each pipelined strategy."""
    best: dict[str, dict[str, Any]] = {}
    for r in ok:
        if r.get("split_size") in ("", None):
            continue
        key = _label(r)
        if key not in best or r["throughput_img_s"] > best[key]["throughput_img_s"]:
            best[key] = r
    return ", ".join(f"{k} {r['split_size']}" for k, r in sorted(best.items())) or "-"


def headline_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The headlines as aligned text lines (a header, then one line per workload)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["model"], r["image_size"], r["batch_size"], r["precision"])].append(r)
    header = (f"{'model':<10} {'image':>5} {'batch':>5} {'prec':<4}  {'best':<22} "
              f"{'img/s':>8} {'vs single':>9}  best split per pipelined strategy")
    lines = [header]
    for (model, image, batch, precision), group in sorted(groups.items()):
        ok = [r for r in group if r["status"] == "ok"]
        head = f"{model:<10} {image:>5} {batch:>5} {precision:<4}  "
        if not ok:
            statuses = sorted({r["status"] for r in group})
            lines.append(head + f"no case ran ({', '.join(statuses)})")
            continue
        best = max(ok, key=lambda r: r["throughput_img_s"])
        single = next((r for r in ok if r["strategy"] == "single"), None)
        speedup = (f"{best['throughput_img_s'] / single['throughput_img_s']:.2f}x"
                   if single else "n/a")
        name = _label(best) + (f" s{best['split_size']}" if best.get("split_size") else "")
        lines.append(head + f"{name:<22} {best['throughput_img_s']:>8.1f} {speedup:>9}  "
                     + _best_splits(ok))
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
