"""Command line: ``python -m bench_lib <command>`` (or ``parabench <command>``): parse ->
plan -> run | report | compare | gate | tune | parity | distance; one module per command
(``parser.COMMANDS``), each with ``HELP``, ``add_arguments(parser)`` and ``command(args)``.

Exit codes: ``bench_lib.exit_codes``.
"""

from __future__ import annotations

import sys

from bench_lib.commands.parser import COMMANDS, build_parser
from bench_lib.exit_codes import EXIT_INTERRUPTED, EXIT_USAGE
from bench_lib.processes.interrupts import shielded

__all__ = ["COMMANDS", "build_parser", "main"]


_BAD_INPUT = (("bench_lib.sweep.profile", "UsageError"), ("bench_lib.rig", "RigError"),
             ("bench_lib.workloads", "WorkloadError"), ("bench_lib.results.schema", "ResultsError"))
"""The errors that mean bad input, as (module, class): printed as ``error: ...``, exit 2."""


def _bad_input_errors() -> tuple[type[Exception], ...]:
    """The classes of ``_BAD_INPUT`` whose modules this process has imported: an error of a
    module never imported was never raised, and importing the rig's or the sweep's here
    would bring torch into a command that only reads files."""
    return tuple(getattr(sys.modules[module], name) for module, name in _BAD_INPUT
                 if module in sys.modules)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run its command; its exit code. Bad
    input the command finds (a usage, rig, workload or results error) is printed as
    ``error: ...`` and exits 2; a Ctrl-C the command does not handle itself exits 130
    (``EXIT_INTERRUPTED``). CUDA numbers GPUs in PCI bus order in this process and
    every child it starts, unless the user chose an order (``nvml.order_cuda_by_bus``)."""
    from bench_lib.nvml import order_cuda_by_bus

    try:
        order_cuda_by_bus()
        # Building a command's flags imports what it runs (torch, for some): held from a
        # Ctrl-C, whose KeyboardInterrupt torch's C++ would swallow as it imports numpy,
        # leaving a half-imported numpy to fail later (processes.interrupts).
        with shielded():
            parser = build_parser(sys.argv[1:] if argv is None else argv)
        args = parser.parse_args(argv)
        code: int = COMMANDS[args.command].command(args)
        return code
    except _bad_input_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # where the command does not say more (run, tune do)
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
