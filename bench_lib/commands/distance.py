"""``distance``: the pairwise distance of a conv weight's kernels (bench_lib.distance)."""

from __future__ import annotations

import argparse

from bench_lib.commands.common import add_rig_args, gpu_slots
from bench_lib.rig import detect_rig

HELP = ("time the pairwise distance of a conv weight's kernels (a loop, blocked cdist, split "
        "over devices); exit 1 when one disagrees")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bench_lib.distance import run

    run.add_arguments(p)
    add_rig_args(p)


def command(args: argparse.Namespace) -> int:
    from bench_lib.distance import run

    rig = detect_rig(args.rig, args.devices, args.threads_per_worker, gpu_slots=gpu_slots(args))
    return run.command(args, rig)
