import sys

from bench_lib.nvml import order_cuda_by_bus  # torch-free
from bench_lib.processes import forkserver  # torch-free: the server starts before our imports
from bench_lib.run.agent import WARM_MODULES  # torch-free

order_cuda_by_bus()  # before the fork server copies this environment
forkserver.prestart(sys.argv[1:], WARM_MODULES)

from bench_lib.commands import main  # noqa: E402
from bench_lib.processes.lifeline import exit_lightly  # noqa: E402

exit_lightly(main())
