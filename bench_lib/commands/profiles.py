"""``profiles``: every shipped profile with its cases and estimated duration on this rig."""

from __future__ import annotations

import argparse

from bench_lib.commands.common import add_rig_args, rig_of
from bench_lib.exit_codes import EXIT_OK

HELP = "list the profiles: name, cases and estimated duration on this rig, description"
EXAMPLES = """\
  python -m bench_lib profiles
  python -m bench_lib profiles --rig cuda --devices 2   # estimates for a 2-GPU box"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_rig_args(p)


def command(args: argparse.Namespace) -> int:
    """Every shipped profile on this rig (``default``: the one it picks): its cases, the
    estimated duration of a run, its description. The other kind's default profile is
    planned on a rig of that kind with as many devices (a cuda sweep's hours on CPU workers
    would answer no one's question), and says so."""
    from bench_lib.prediction.duration import case_seconds, format_duration
    from bench_lib.rig import RIG_KINDS
    from bench_lib.rig_detection import detect_rig
    from bench_lib.sweep.expansion import expand
    from bench_lib.sweep.profile import load_profile, profile_names, profile_path

    rig = rig_of(args, plan_only=True)
    names = [n for n in profile_names() if n != "default"]
    width = max(len(n) for n in names)
    print(f"{'profile':<{width}}  cases  estimate  description (rig {rig.label}; `default` "
          f"is default-{rig.kind})")
    for name in names:
        profile = load_profile(profile_path(name, rig.kind))
        on = rig
        for kind in RIG_KINDS:
            if kind != rig.kind and name == f"default-{kind}":
                on = detect_rig(kind, rig.num_devices, plan_only=True)
        cases = expand(profile, on)
        runs = [c for c in cases if c.status is None]
        seconds = sum(case_seconds(c, on) for c in runs)
        where = "" if on is rig else f"(planned on {on.label}) "
        print(f"{name:<{width}}  {len(runs):>5}  {format_duration(seconds):>8}  "
              f"{where}{profile.description}")
    return EXIT_OK
