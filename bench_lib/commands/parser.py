"""The command line's parser: one subcommand per module of ``bench_lib.commands``."""

from __future__ import annotations

import argparse
from types import ModuleType
from typing import Any

from bench_lib.commands import (
    baseline,
    compare,
    distance,
    env,
    gate,
    merge,
    parity,
    profiles,
    report,
    run,
    tune,
)

# name -> module with HELP, add_arguments(parser) and command(args) -> exit code; in the
# order ``--help`` lists them.
COMMANDS: dict[str, ModuleType] = {
    "run": run, "env": env, "profiles": profiles, "compare": compare, "gate": gate,
    "baseline": baseline, "report": report, "merge": merge, "parity": parity,
    "distance": distance, "tune": tune,
}


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """A parser's subcommands by name (argparse keeps them nowhere public); none: {}."""
    return {name: sub for action in parser._actions
            if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}


class Parser(argparse.ArgumentParser):
    """No abbreviated flags (``--image-size`` is not taken for ``--image-sizes``), and an
    unknown flag answered by its command's usage with the nearest flag it has."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            import difflib

            command = subcommands(self).get(str(getattr(parsed, "command", "")), self)
            flags = [f for a in command._actions for f in a.option_strings]
            near = difflib.get_close_matches(extras[0].split("=", 1)[0], flags, n=1)
            command.error(f"unrecognized arguments: {' '.join(extras)}"
                          + (f" (did you mean {near[0]}?)" if near else ""))
        return parsed


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: ``--version`` and every command of ``COMMANDS``."""
    from bench_lib import __version__

    parser = Parser(prog="python -m bench_lib",
                    description="Benchmark PyTorch training parallelism strategies.")
    parser.add_argument("--version", action="version", version=f"parabench {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, module in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.HELP))
    return parser
