"""The command line's parser: one subcommand per module of ``bench_lib.commands``.

Torch-free to import, as every command module is: a command's flags that name the
registries' entries (``run``'s strategies and models) import them as they are added, and a
command line that names its command gets that command's flags alone (``build_parser``), so
that ``report``, ``compare`` and ``merge`` start without torch's seconds of imports.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

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
from bench_lib.exit_codes import EXIT_INTERRUPTED, EXIT_NOT_OK, EXIT_OK, EXIT_USAGE

if TYPE_CHECKING:
    from bench_lib.sweep.profile import Profile

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


# Flags renamed (one name per idea: lists plural, units in the name): not accepted, but an
# unknown flag that was one of them is answered with its new name.
RENAMED = {"--batch-size": "--batch-sizes", "--precision": "--precisions",
           "--partition": "--partitions", "--ddp-bucket-cap-mb": "--ddp-bucket-caps-mib",
           "--ddp-powersgd-rank": "--ddp-powersgd-ranks", "--case-timeout": "--case-timeout-s",
           "--ci-target-pct": "--interval-target-pct", "--threshold": "--threshold-pct",
           "--time-budget": "--time-budget-s", "--dtype": "--precision"}


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
            given = extras[0].split("=", 1)[0]
            near = ([RENAMED[given]] if RENAMED.get(given) in flags
                    else difflib.get_close_matches(given, flags, n=1))
            command.error(f"unrecognized arguments: {' '.join(extras)}"
                          + (f" (did you mean {near[0]}?)" if near else ""))
        return parsed


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Examples keep their lines; a flag's default is shown where its help does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default in (None, False, argparse.SUPPRESS) or action.nargs == 0
                or "default" in text or "profile " in text):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {str(shown).replace('%', '%%')})"


EXIT_CODES = "exit codes:" + "".join(f"\n  {code:<4} {meaning}" for code, meaning in (
    (EXIT_OK, "success"),
    (EXIT_NOT_OK, "a case failed (error, timeout), a regression, or a strategy disagrees "
                  "(parity, distance)"),
    (EXIT_USAGE, "bad input: nothing was run or written"),
    (EXIT_INTERRUPTED, "interrupted (a run's finished cases are kept: finish it with run "
                       "--resume RUN_DIR)")))
"""The exit codes every --help lists (``bench_lib.exit_codes`` defines them)."""


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line: ``--version`` and every command of ``COMMANDS``, each with
    its flags; where ``argv`` names a command, that command alone gets its flags (the others
    are listed, and never parse this ``argv``). Where ``argv`` asks for ``run`` or
    ``tune``'s help, each sweep flag's help shows its value in the profile in force
    (``--profile``, else ``default`` for this machine's rig)."""
    from bench_lib import __version__

    parser = Parser(prog="python -m bench_lib", formatter_class=HelpFormatter,
                    description="Benchmark PyTorch training parallelism strategies: time "
                                "single-device, data-parallel, model-parallel and pipelined "
                                "training on this machine's devices.",
                    epilog="examples:\n  python -m bench_lib profiles\n"
                           "  python -m bench_lib run --profile smoke\n"
                           "  python -m bench_lib run --dry-run\n"
                           "  python -m bench_lib run --help\n\n" + EXIT_CODES)
    parser.add_argument("--version", action="version", version=f"parabench {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    named = argv[0] if argv and argv[0] in COMMANDS else None
    for name, module in COMMANDS.items():
        command = sub.add_parser(name, help=module.HELP, description=module.HELP,
                                 formatter_class=HelpFormatter,
                                 epilog=f"examples:\n{module.EXAMPLES}\n\n{EXIT_CODES}")
        if named not in (None, name):
            continue
        module.add_arguments(command)
        if hasattr(command.get_default("sweep_flags"), "__len__"):
            show_profile_values(command, _help_profile(argv, name))
    return parser


def _help_profile(argv: Sequence[str] | None, command: str) -> Profile | None:
    """The profile ``argv`` runs ``command`` with, where it asks for that command's help
    (None otherwise: the generated reference names no machine's profile)."""
    args = list(argv or ())
    if not args or args[0] != command or not {"-h", "--help"} & set(args):
        return None
    from bench_lib.rig_detection import cuda_device_count
    from bench_lib.sweep.profile import UsageError, load_profile, profile_path

    def given(flag: str) -> str | None:
        for i, arg in enumerate(args):
            if arg == flag and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
        return None

    kind = given("--rig") or ("cuda" if cuda_device_count() > 0 else "cpu")
    try:
        return load_profile(profile_path(given("--profile") or "default", kind))
    except (UsageError, ValueError):
        return None  # the command itself says what is wrong with the profile


def show_profile_values(command: argparse.ArgumentParser, profile: Profile | None) -> None:
    """Each sweep flag's help ends with its value in ``profile`` (flags > profile file >
    defaults), or says that the profile in force gives it."""
    from bench_lib.sweep.profile import Profile

    values = profile.as_dict() if profile is not None else {}
    for action in command._actions:
        if action.dest not in Profile.keys() or not action.help:
            continue
        if profile is None:
            action.help += " (default: the profile's)"
            continue
        value = values[action.dest]
        if isinstance(value, bool):
            value = "on" if value else "off"
        elif value is None:  # resolved later: the flag's help says how (--min-time-s)
            value = "unset"
        elif isinstance(value, (list, tuple)):
            value = ",".join(map(str, value)) or "none"
        elif isinstance(value, dict):
            value = ", ".join(f"{k} px: {','.join(map(str, v))}" for k, v in value.items()) \
                or "none"
        action.help += f" (profile {profile.name}: {str(value).replace('%', '%%')})"
