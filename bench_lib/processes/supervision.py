"""One launch's processes in a process group of their own: started (``start_group``),
watched until they end or must be stopped (``supervise``: a time limit, a caller's reason
to stop them such as a memory cap, a dead process's peers given their grace), and killed,
group and all (``kill_group``). Every launcher's one loop: a case's ranks (``launch.ranks``),
a calibration's (``prediction.calibration``), a distance case's (``distance.launch``) and a parity
run's (``parity.launch``). Torch-free.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from bench_lib.processes.forkserver import ForkServer, start_module

POLL_S = 0.1
PEER_GRACE_S = 10.0
"""After one process dies, how long its peers get to notice and exit (writing their own
failure) before the group is killed (``supervise``'s default)."""


class Rank(Protocol):
    """A process a launcher started: a ``Popen``, or a ``forkserver.Forked``."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...


def start_group(server: ForkServer | None, module: str, args: Sequence[Sequence[str]],
                log_path: Path) -> list[Rank]:
    """Start ``python -m MODULE ARGS...`` once per entry of ``args`` (rank order), all in
    one new process group that the first leads, output appended to ``log_path``: forked by
    ``server`` where given (``processes.forkserver``), else each a fresh interpreter."""
    procs: list[Rank] = []
    for rank_args in args:
        group = procs[0].pid if procs else 0  # 0: a new group led by the first
        procs.append(start_module(server, module, rank_args, log_path, group=group))
    return procs


def kill_group(pgid: int) -> None:
    """SIGKILL a launch's whole process group: stuck peers, and any children they started."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def supervise(
    procs: Sequence[Rank], timeout_s: float,
    over_cap: Callable[[], str | None] | None = None,
    exited_at: dict[int, float] | None = None,
    watch: Callable[[], tuple[str, str] | None] | None = None,
    kill: Callable[[], None] | None = None,
    grace_s: float = PEER_GRACE_S,
) -> tuple[str, str] | None:
    """Wait for the processes (``start_group``'s: the first leads their group); returns
    (status, reason) when they had to be stopped: ``timeout`` past ``timeout_s``, or
    ``oom``; None when they all ended, or one failed and its peers' ``grace_s`` is over.

    ``over_cap`` says why the ranks hold more memory than allowed (they are then an oom).
    ``exited_at`` gets, for each rank that exited on its own (not killed here), the
    wall-clock time (``time.time()``) of the last poll that still saw it running: a lower
    bound of when it ended (0.0 if the first poll found it gone). ``watch``, called at each
    poll, says why to stop them now (under torchrun: a memory cap, another node's state).
    Kills the whole process group whatever happens, including on KeyboardInterrupt (or calls
    ``kill`` instead: torchrun's ranks are not in the agent's group).
    """
    pgid = procs[0].pid
    deadline = time.monotonic() + timeout_s
    first_failure: float | None = None
    seen_running = 0.0
    try:
        while True:
            polled = time.time()
            codes = [p.poll() for p in procs]
            if exited_at is not None:
                for rank, code in enumerate(codes):
                    if code is not None and rank not in exited_at:
                        exited_at[rank] = seen_running
            seen_running = polled
            if all(c is not None for c in codes):
                return None
            now = time.monotonic()
            if now > deadline:
                return "timeout", f"case still running after {timeout_s:g} s; killed"
            if over_cap is not None and (reason := over_cap()):
                return "oom", reason
            if watch is not None and (stop := watch()):
                return stop
            if first_failure is None and any(c not in (None, 0) for c in codes):
                first_failure = now
            if first_failure is not None and now - first_failure > grace_s:
                return None
            time.sleep(POLL_S)
    finally:
        # Kill the whole group: stuck peers, and any children the ranks started.
        if kill is None:
            kill_group(pgid)
        else:
            kill()
        for p in procs:
            p.wait()
