"""torchrun's agent, started tied to the runner: no process of a case outlives its runner.

    python -m bench_lib.launch.agent RUNNER_PID SPEC_JSON TORCHRUN_ARG...

starts a case's torchrun agent: it asks to be killed when the runner dies
(``processes.lifeline.die_with_parent``), then *becomes* ``python -m torch.distributed.run
TORCHRUN_ARG... -m bench_lib.launch.worker SPEC_JSON env AGENT_PID`` (``os.execv``: the same
process, so the runner's ``Popen`` is the agent, and the parent-death signal survives the
exec). The workers the agent starts get the agent's pid, and ask in turn to die with it. So
a runner killed with SIGKILL takes its agent with it, and the agent its workers; torchrun
starts each worker in a session of its own, out of reach of a signal to the agent's process
group, so this chain is what ends them.

Torch-free on purpose: the agent must arm its signal before seconds of imports.
"""

from __future__ import annotations

import os
import sys

from bench_lib.processes.lifeline import EXIT_ORPHANED, die_with_parent

WORKER_MODULE = "bench_lib.launch.worker"
WARM_MODULES = (WORKER_MODULE,)
"""What a run's fork server imports before it forks anything (``processes.forkserver``): a
case's worker, and with it torch, torchvision, the strategies and the workloads, which every
process it forks (ranks, calibrations, the FLOP probe, the collectives, the distance and
parity ranks) then finds imported. Named here, torch-free, so that the entry point can start
the server before its own imports (``forkserver.prestart``)."""
RANK_FROM_ENV = "env"
"""The worker's RANK argument under torchrun: read RANK, LOCAL_RANK... from the environment."""


def agent_argv(spec_path: str, torchrun_args: list[str], agent_pid: int) -> list[str]:
    """The command line the agent execs: torchrun, then the worker as a module, told to
    read its rank from torchrun's environment and to die with the agent (``agent_pid``)."""
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args,
            "-m", WORKER_MODULE, spec_path, RANK_FROM_ENV, str(agent_pid)]


def main(argv: list[str]) -> int:
    """RUNNER_PID SPEC_JSON TORCHRUN_ARG...: tie to the runner, then exec torchrun."""
    runner_pid, spec_path, torchrun_args = int(argv[0]), argv[1], argv[2:]
    if not die_with_parent(runner_pid):
        print("the runner is gone; not starting torchrun", file=sys.stderr)
        return EXIT_ORPHANED
    args = agent_argv(spec_path, torchrun_args, os.getpid())
    sys.stdout.flush()
    os.execv(args[0], args)
    return 0  # not reached: execv replaces this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
