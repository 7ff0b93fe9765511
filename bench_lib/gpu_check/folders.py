"""What a cuda run folder must hold, read from its files (no torch, no device).

- every case ok, unsupported or skipped (an error, timeout or out-of-memory on the check's
  grid is a problem, with its reason);
- per run: a measured FLOP peak and idle power in env.json (the peak labelled in the
  validation mode), collectives measured where a case is priced with them, no test hook set;
- per ok case: utilisation, read from GPM SM activity or NVML kernel-active time
  (``util_source``); power and energy per image, gross and net of idle power (left empty
  only where slots share a GPU or the GPU is a MIG instance, which the row says); MFU (empty,
  said, in the validation mode); the CUDA allocator's peak; the bubble of each pipelined case.

A figure a row computes from a run's figure (MFU from the FLOP peak, net energy from idle
power) is a problem of the row only where the run has that figure: where it does not, the
run's problem says so once, with why (a profile with ``rig_figures = false`` measures none).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench_lib.analysis.bound import MOVING_ACROSS_GPUS, PRICED_WITH_COLLECTIVES
from bench_lib.analysis.bubble import SCHEDULES
from bench_lib.analysis.utilisation import LABELS, source_labels
from bench_lib.results.read import devices_label

FINE = ("ok", "unsupported", "skipped")
GPU_SOURCES = {LABELS["sm_util_pct"], LABELS["util_gpu_pct"]}
"""The utilisation sources that are a GPU's own counters."""
Row = Mapping[str, Any]


def _empty(value: object) -> bool:
    return value is None or str(value).strip() == ""


def case_problems(row: Row, validation: bool, peak_measured: bool,
                  idle_measured: bool) -> list[str]:
    """What an ok GPU case's row lacks (``validation``: a --gpu-slots run; ``peak_measured``
    and ``idle_measured``: env.json has the run's FLOP peak and idle power), each with the
    row's own reason where it gives one."""
    out = []
    note = str(row.get("sampler_note") or "")
    why = f" (sampler_note: {note})" if note else ""
    if _empty(row.get("util_pct_mean")):
        out.append(f"no utilisation{why}")
    elif not source_labels(str(row.get("util_source") or "")) <= GPU_SOURCES:
        out.append(f"utilisation from {row.get('util_source')!r}, not a GPU counter")
    # Slots sharing a GPU, and a MIG instance (its card's counters), say why they have none.
    if "power and energy left empty" not in note and "MIG instance" not in note:
        for column in ("power_w_mean", "energy_j_per_img"):
            if _empty(row.get(column)):
                out.append(f"no {column}{why}")
        if idle_measured and _empty(row.get("energy_j_per_img_net")):
            out.append(f"no energy_j_per_img_net{why}")
    if peak_measured and not validation and _empty(row.get("mfu_pct")):
        out.append(f"no mfu_pct ({row.get('mfu_note') or 'no note'})")
    if _empty(row.get("peak_mem_reserved_mib_max")):
        out.append("no CUDA allocator peak (peak_mem_reserved_mib_max)")
    if row.get("strategy") in SCHEDULES and _empty(row.get("bubble_measured_pct")):
        out.append(f"no measured bubble ({row.get('note') or 'no note'})")
    return out


def rig_figure_problems(env: Mapping[str, Any], validation: bool) -> tuple[list[str], bool, bool]:
    """env.json's FLOP peak and idle power: their problems, and whether each was measured.
    A profile that turns them off gets one problem saying so, not one per missing figure."""
    peak = env.get("attainable_peak") or {}
    peak_measured = "unsupported" not in peak and bool(peak.get("tflop_s"))
    idle = env.get("idle_power") or {}
    idle_measured = bool(idle) and "unsupported" not in idle
    profile = env.get("profile") or {}
    if profile.get("rig_figures") is False:
        return ([f"env.json: rig figures not measured (profile {profile.get('name')!r} has "
                "rig_figures = false): no FLOP peak and no idle power, so no row has MFU or "
                "net energy; gpu_check's own sweeps (profile gpu-check) measure them"],
                peak_measured, idle_measured)
    out = []
    if not peak_measured:
        out.append(f"env.json: no measured FLOP peak ({peak.get('unsupported', 'empty')})")
    elif validation and not peak.get("note"):
        out.append("env.json: the validation mode's FLOP peak is not labelled as a share")
    if not idle_measured:
        out.append(f"env.json: no idle power ({idle.get('unsupported', 'empty')})")
    return out, peak_measured, idle_measured


def collectives_problems(cases: Sequence[Row], env: Mapping[str, Any]) -> list[str]:
    """A problem where ok cases over 2 devices or more are priced with collectives and
    env.json has none measured: their bounds (and the waterfall's communication part) are
    missing or count none."""
    skipped = (env.get("collectives") or {}).get("skipped")
    slots = int((env.get("rig") or {}).get("gpu_slots") or 1) > 1
    # As ``prediction.collectives.largest_message`` decides which runs measure them.
    strategies = PRICED_WITH_COLLECTIVES | (set() if slots else MOVING_ACROSS_GPUS)
    priced = [str(r.get("case_id")) for r in cases if r.get("status") == "ok"
              and r.get("strategy") in strategies and int(r.get("world_size") or 1) > 1]
    if not skipped or not priced:
        return []
    return [f"env.json: no collectives measured ({skipped}): the bounds of "
            f"{', '.join(priced)} are missing or count no communication"]


def run_problems(cases: Sequence[Row], env: Mapping[str, Any]) -> list[str]:
    """Every problem of one run folder: its env.json's, then each case's (``case_id: ...``)."""
    rig = env.get("rig") or {}
    if rig.get("kind") != "cuda":
        return [f"rig {rig.get('label')!r} is not a cuda rig: no GPU path ran"]
    validation = int(rig.get("gpu_slots") or 1) > 1
    out, peak_measured, idle_measured = rig_figure_problems(env, validation)
    out += collectives_problems(cases, env)
    hooks = env.get("test_hooks") or {}
    if hooks:
        out.append(f"env.json: made with test-only hooks set ({', '.join(sorted(hooks))}): "
                   "not a real measurement")
    for row in cases:
        status = row.get("status")
        if status not in FINE:
            out.append(f"{row.get('case_id')}: {status}: {row.get('reason')}")
        elif status == "ok":
            out += [f"{row.get('case_id')}: {p}"
                    for p in case_problems(row, validation, peak_measured, idle_measured)]
    return out


def case_line(row: Row) -> str:
    """One case as the check prints it."""
    def num(column: str, fmt: str) -> str:
        value = row.get(column)
        return "-" if _empty(value) else format(float(str(value)), fmt)

    head = f"{row.get('case_id')}: {row.get('status')}"
    if row.get("status") != "ok":
        return f"{head} ({row.get('reason')})"
    parts = [f"step {num('step_time_s_median', '.4f')} s",
             f"util {num('util_pct_mean', '.0f')}% [{row.get('util_source') or '-'}]",
             f"timeline busy {num('util_timeline_pct', '.0f')}%",
             f"{num('energy_j_per_img', '.3f')} J/img", f"MFU {num('mfu_pct', '.1f')}%",
             f"stop {row.get('stop_reason') or '-'}"]
    flags = [str(row[c]) for c in ("util_check", "throttled") if not _empty(row.get(c))]
    return f"{head}: " + ", ".join(parts) + "".join(f"\n    ! {f}" for f in flags)


def read_run(run_dir: Path) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """cases.csv's rows and env.json of a run folder."""
    with (run_dir / "cases.csv").open(newline="") as f:
        cases = list(csv.DictReader(f))
    return cases, json.loads((run_dir / "env.json").read_text())


def check(run_dirs: Sequence[Path]) -> list[str]:
    """Print every case and problem of ``run_dirs``; their problems (``folder: problem``)."""
    found = []
    for run_dir in run_dirs:
        cases, env = read_run(run_dir)
        print(f"\n== {run_dir} ({(env.get('rig') or {}).get('label')}, {devices_label(env)})")
        for row in cases:
            print("  " + case_line(row))
        for p in run_problems(cases, env):
            print(f"  PROBLEM {p}")
            found.append(f"{run_dir}: {p}")
    return found


def unreadable(run_dirs: Sequence[Path]) -> list[str]:
    """Why each of ``run_dirs`` that is not a run folder is not (no cases.csv or env.json)."""
    return [f"{d}: not a run folder (no {name})" for d in run_dirs
            for name in ("cases.csv", "env.json") if not (d / name).is_file()]
