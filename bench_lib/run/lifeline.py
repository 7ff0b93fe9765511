"""No process of a case outlives its runner: the parent-death signal, and torchrun's agent
started tied to the runner.

    python -m bench_lib.run.lifeline RUNNER_PID SPEC_JSON TORCHRUN_ARG...

starts a case's torchrun agent: it asks to be killed when the runner dies, then *becomes*
``python -m torch.distributed.run TORCHRUN_ARG... -m bench_lib.run.worker SPEC_JSON env
AGENT_PID`` (``os.execv``: the same process, so the runner's ``Popen`` is the agent, and the
parent-death signal survives the exec). The workers the agent starts get the agent's pid,
and ask in turn to die with it. So a runner killed with SIGKILL takes its agent with it, and
the agent its workers; torchrun starts each worker in a session of its own, out of reach of
a signal to the agent's process group, so this chain is what ends them.

Torch-free on purpose: the agent must arm its signal before seconds of imports.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
EXIT_ORPHANED = 4
"""The runner (or agent) was gone before this process could tie itself to it."""
WORKER_MODULE = "bench_lib.run.worker"
RANK_FROM_ENV = "env"
"""The worker's RANK argument under torchrun: read RANK, LOCAL_RANK... from the environment."""


def die_with_parent(parent_pid: int | None,
                    prctl: Callable[[int, int], object] | None = None) -> bool:
    """Ask for SIGKILL when the parent dies, so that no rank outlives it; False: the parent
    (``parent_pid``) is already gone, and this process should exit at once.

    Linux only (prctl ``PR_SET_PDEATHSIG``); elsewhere the runner's own cleanup has to do.
    Asked by the child as it starts, not in a ``preexec_fn`` of the runner's ``Popen``: that
    runs between fork and exec in a runner that already has threads (progress, CUDA driver),
    where Python documents that the child can deadlock. The signal comes only for a parent
    that dies after the call (the thread that started the child: the runner starts cases
    from its main thread), so the parent is then checked against ``parent_pid``: a child
    whose parent died before (it was re-parented) learns it here.
    """
    if not sys.platform.startswith("linux"):
        return True
    if prctl is None:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    return parent_pid is None or os.getppid() == parent_pid


def exit_lightly(code: int | None) -> NoReturn:
    """``sys.exit(code)`` without the interpreter walking its whole heap on the way out.

    With torch and torchvision imported, the garbage collections of Python's teardown take
    ~1 s of CPU (2 cores, AMD EPYC: ``import bench_lib.run.worker`` then exit, 3.0-3.6 s
    against 2.3-2.4 s with ``os._exit``), paid by every runner, worker, fork server and
    test subprocess. ``gc.freeze()`` moves every object to the permanent generation, which
    no collection visits; atexit handlers, buffered streams and ``finally`` blocks still
    run. Call it only where nothing left relies on a cycle's finalizer (files are closed by
    ``with``)."""
    import gc

    gc.freeze()
    sys.exit(code)


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
