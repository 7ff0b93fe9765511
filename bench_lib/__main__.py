# Every import here is torch-free: the fork server starts before our imports.
import signal
import sys

from bench_lib.exit_codes import EXIT_INTERRUPTED
from bench_lib.launch.agent import WARM_MODULES
from bench_lib.nvml import order_cuda_by_bus
from bench_lib.processes import forkserver, interrupts
from bench_lib.processes.lifeline import exit_lightly

# Ctrl-C as Python's default raises it, except inside a shield (processes.interrupts); an
# ignored SIGINT stays ignored (a command that wants it, `run`, catches it itself).
if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    interrupts.catch(signal.SIGINT)
try:
    order_cuda_by_bus()  # before the fork server copies this environment
    forkserver.prestart(sys.argv[1:], WARM_MODULES)

    from bench_lib.commands import main

    code = main()
except KeyboardInterrupt:  # before the command's own handling began (commands.main)
    print("interrupted", file=sys.stderr)
    code = EXIT_INTERRUPTED
interrupts.keep_exit_code()  # the exit code is decided: a late Ctrl-C must not change it
exit_lightly(code)
