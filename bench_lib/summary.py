"""The short end-of-run summary: per image size, the best strategy and its speedup."""

from __future__ import annotations

from collections import defaultdict


def summary_lines(rows: list[dict]) -> list[str]:
    """Lines like ``img 128: best ddp 1.92x single (b32); pipeline best split 8``."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["model"], r["image_size"], r["batch_size"], r["precision"])].append(r)
    lines = []
    for (model, image, batch, precision), group in sorted(groups.items()):
        ok = [r for r in group if r["status"] == "ok"]
        counts = {s: sum(r["status"] == s for r in group) for s in {r["status"] for r in group}}
        tally = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        head = f"{model} img {image} batch {batch} {precision}: "
        if not ok:
            lines.append(head + f"no case ran ({tally})")
            continue
        best = max(ok, key=lambda r: r["throughput_img_s"])
        single = next((r for r in ok if r["strategy"] == "single"), None)
        speed = (f" = {best['throughput_img_s'] / single['throughput_img_s']:.2f}x single"
                 if single else "")
        text = (f"best {best['strategy']}"
                + (f" (split {best['split_size']})" if best["split_size"] != "" else "")
                + f" {best['throughput_img_s']:.1f} img/s{speed}")
        for strat in sorted({r["strategy"] for r in ok if r["split_size"] != ""}):
            cands = [r for r in ok if r["strategy"] == strat]
            top = max(cands, key=lambda r: r["throughput_img_s"])
            text += f"; {strat} best split {top['split_size']}"
        lines.append(head + text + f" [{tally}]")
    return lines
