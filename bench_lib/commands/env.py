"""``env``: the environment a run would record, as JSON."""

from __future__ import annotations

import argparse
import json
import sys

from bench_lib.commands.common import add_rig_args, rig_of
from bench_lib.exit_codes import EXIT_OK

HELP = "print the environment a run would record (JSON)"
EXAMPLES = """\
  python -m bench_lib env
  python -m bench_lib env --rig cpu --devices 2"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_rig_args(p)


def command(args: argparse.Namespace) -> int:
    from bench_lib.measure import environment

    rig = rig_of(args)
    print(json.dumps(environment.collect(rig, {}, sys.argv), indent=2, default=str))
    return EXIT_OK
