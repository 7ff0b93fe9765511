"""The GPU paths checked on a GPU box in one command: what a session lent a GPU, or a user on
a new box, runs before trusting the GPU numbers (issue #28's done-when, with `make test`).

    .venv/bin/python benchmarks/gpu_check.py [--out DIR]        # run both sweeps, check them
    .venv/bin/python benchmarks/gpu_check.py --runs DIR [DIR...] # check run folders only

It runs `run --profile smoke` (every visible GPU, up to the profile's devices) and
`run --devices 2 --gpu-slots 2 --profile smoke` (the validation mode: two worker slots
sharing GPU 0), then reads each run folder and checks what a GPU row must hold:

- every case ok, unsupported or skipped (an error, timeout or out-of-memory on the smoke
  grid is a problem, with its reason);
- per ok case: utilisation, read from GPM SM activity or NVML kernel-active time
  (``util_source``); power and energy per image, gross and net of idle power (left empty
  only where slots share a GPU or the GPU is a MIG instance, which the row says); MFU
  (empty, said, in the validation mode); the CUDA allocator's peak; the bubble of each
  pipelined case;
- per run: a measured FLOP peak and idle power in env.json, the peak labelled in the
  validation mode.

Prints one line per case (its utilisation and where it came from, the timeline's busy
share and their check, throttling, what ended timing) and every problem. Exit 0: none;
1: some; 2: no CUDA GPU visible, or a sweep that could not start.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_lib.analysis.bubble import SCHEDULES  # noqa: E402
from bench_lib.analysis.utilisation import LABELS, source_labels  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SWEEPS = {"smoke": ["--profile", "smoke"],
          "slots": ["--devices", "2", "--gpu-slots", "2", "--profile", "smoke"]}
"""Run folder name under --out -> the `run` flags that make it."""
FINE = ("ok", "unsupported", "skipped")
GPU_SOURCES = {LABELS["sm_util_pct"], LABELS["util_gpu_pct"]}
"""The utilisation sources that are a GPU's own counters."""
Row = Mapping[str, Any]


def _empty(value: object) -> bool:
    return value is None or str(value).strip() == ""


def case_problems(row: Row, validation: bool, idle_measured: bool) -> list[str]:
    """What an ok GPU case's row lacks (``validation``: a --gpu-slots run; ``idle_measured``:
    env.json has the run's idle power), each with the row's own reason where it gives one."""
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
    if not validation and _empty(row.get("mfu_pct")):
        out.append(f"no mfu_pct ({row.get('mfu_note') or 'no note'})")
    if _empty(row.get("peak_mem_reserved_mib_max")):
        out.append("no CUDA allocator peak (peak_mem_reserved_mib_max)")
    if row.get("strategy") in SCHEDULES and _empty(row.get("bubble_measured_pct")):
        out.append(f"no measured bubble ({row.get('note') or 'no note'})")
    return out


def run_problems(cases: Sequence[Row], env: Mapping[str, Any]) -> list[str]:
    """Every problem of one run folder: its env.json's, then each case's (``case_id: ...``)."""
    out = []
    rig = env.get("rig") or {}
    if rig.get("kind") != "cuda":
        return [f"rig {rig.get('label')!r} is not a cuda rig: no GPU path ran"]
    validation = int(rig.get("gpu_slots") or 1) > 1
    peak = env.get("attainable_peak") or {}
    if "unsupported" in peak or not peak.get("tflop_s"):
        out.append(f"env.json: no measured FLOP peak ({peak.get('unsupported', 'empty')})")
    elif validation and not peak.get("note"):
        out.append("env.json: the validation mode's FLOP peak is not labelled as a share")
    idle = env.get("idle_power") or {}
    idle_measured = bool(idle) and "unsupported" not in idle
    if not idle_measured:
        out.append(f"env.json: no idle power ({idle.get('unsupported', 'empty')})")
    for row in cases:
        status = row.get("status")
        if status not in FINE:
            out.append(f"{row.get('case_id')}: {status}: {row.get('reason')}")
        elif status == "ok":
            out += [f"{row.get('case_id')}: {p}"
                    for p in case_problems(row, validation, idle_measured)]
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


def check(run_dirs: Sequence[Path]) -> int:
    """Print every case and problem of ``run_dirs``; the number of problems."""
    total = 0
    for run_dir in run_dirs:
        cases, env = read_run(run_dir)
        print(f"\n== {run_dir} ({(env.get('rig') or {}).get('label')}, "
              f"{', '.join(env.get('device_names') or []) or 'no device names'})")
        for row in cases:
            print("  " + case_line(row))
        problems = run_problems(cases, env)
        for p in problems:
            print(f"  PROBLEM {p}")
        total += len(problems)
    return total


def gpus_visible() -> int:
    """CUDA GPUs this process would see, through NVML (no CUDA context); 0 where none."""
    from bench_lib.nvml import cuda_visible_gpus

    try:
        return len(cuda_visible_gpus())
    except Exception as e:  # no NVML library or driver: no GPU to check
        print(f"NVML: {type(e).__name__}: {e}", file=sys.stderr)
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "results" / "gpu-check",
                        help="folder receiving one folder per sweep (default: %(default)s)")
    parser.add_argument("--runs", type=Path, nargs="+", metavar="DIR",
                        help="check these run folders and run nothing")
    args = parser.parse_args(argv)
    if args.runs:
        dirs = list(args.runs)
    else:
        if gpus_visible() == 0:
            print("error: no CUDA GPU visible (NVML): nothing to check here", file=sys.stderr)
            return 2
        dirs = []
        for name, flags in SWEEPS.items():
            out = args.out / name
            command = [sys.executable, "-m", "bench_lib", "run", *flags, "--out", str(out)]
            print(f"\n$ {' '.join(command)}", flush=True)
            code = subprocess.call(command, cwd=REPO)
            if not (out / "latest-run").exists():
                print(f"error: `run` exited {code} and wrote no run folder", file=sys.stderr)
                return 2
            if code != 0:
                print(f"(`run` exited {code}: the cases below say why)")
            dirs.append(out / "latest-run")
    problems = check(dirs)
    print(f"\n{problems} problem{'s' * (problems != 1)} in {len(dirs)} run folder"
          f"{'s' * (len(dirs) != 1)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
