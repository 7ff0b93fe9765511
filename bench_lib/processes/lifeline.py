"""No process outlives the one that started it: the parent-death signal, and a light exit.

Every process the suite starts (a case's ranks, torchrun's agent: ``launch.agent``, the fork
server and what it forks, the FLOP probe, the collective micro-benchmark, the pre-flight
check, the calibration, parity's and distance's ranks) asks as it starts to be killed when
its parent dies (``die_with_parent``), and leaves through ``exit_lightly``.

Torch-free on purpose: a process must arm its signal before seconds of imports.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
EXIT_ORPHANED = 4
"""The parent (the runner, torchrun's agent, the fork server) was gone before this process
could tie itself to it."""


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


def argv_pid(argv: Sequence[str], index: int) -> int | None:
    """The parent's pid a child was given at ``argv[index]``, or None where it was not."""
    return int(argv[index]) if len(argv) > index else None


def exit_if_orphaned(parent_pid: int | None) -> None:
    """``die_with_parent``, and where the parent is already gone, exit at once
    (``EXIT_ORPHANED``) saying so. A child's first call, before its heavy imports."""
    if not die_with_parent(parent_pid):
        print("the runner is gone; not starting", file=sys.stderr)
        sys.exit(EXIT_ORPHANED)


def exit_lightly(code: int | None) -> NoReturn:
    """``sys.exit(code)`` without the interpreter walking its whole heap on the way out.

    With torch and torchvision imported, the garbage collections of Python's teardown take
    ~1 s of CPU (2 cores, AMD EPYC: ``import bench_lib.launch.worker`` then exit, 3.0-3.6 s
    against 2.3-2.4 s with ``os._exit``), paid by every runner, worker, fork server and
    test subprocess. ``gc.freeze()`` moves every object to the permanent generation, which
    no collection visits; atexit handlers, buffered streams and ``finally`` blocks still
    run. Call it only where nothing left relies on a cycle's finalizer (files are closed by
    ``with``)."""
    import gc

    gc.freeze()
    sys.exit(code)
