"""``parity``: every strategy trained on real data from the same weights (bench_lib.parity)."""

from __future__ import annotations

import argparse

from bench_lib.commands.common import add_rig_args, gpu_slots
from bench_lib.rig import detect_rig

HELP = ("train every strategy on real data from the same weights; exit 1 when one learns "
        "differently from single")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bench_lib.parity import run

    run.add_arguments(p)
    add_rig_args(p)


def command(args: argparse.Namespace) -> int:
    from bench_lib.parity import run

    rig = detect_rig(args.rig, args.devices, args.threads_per_worker, gpu_slots=gpu_slots(args))
    return run.command(args, rig)
