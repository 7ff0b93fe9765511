"""The fork server's own process: it imports torch and the worker's modules once (the
modules its caller names), then forks every rank of every launch. The runner's side, which
starts it and talks to it, is ``forkserver``.

    python -m bench_lib.processes.forkserver_process RUNNER_PID [MODULE ...]

A forked rank is a fresh process of its own (``forkserver`` says why forking is worth it)
because the server never runs a torch operation: no intra-op thread pool, no OpenMP
runtime, no CUDA context exists in it to be inherited half-alive (forking after any of
these is unsafe, which is why the server is a process of its own rather than the runner,
which has threads). The one thread pool its imports start is numpy's OpenBLAS, which stops
it around a fork itself (``pthread_atfork``; tests/test_forkserver.py checks that nothing
else runs).

The modules to import before forking come on the command line (``MODULE ...``): the
caller says what its ranks run (the runner: ``launch.agent.WARM_MODULES``), so that this
module names nothing of the library it serves.

Protocol, one JSON object per line. Runner to server (stdin)::

    {"module": "bench_lib.launch.worker", "args": ["/run/.work/case/spec.json", "1", "4100"],
     "stdout": ".../worker.log", "stderr": "", "group": 4242}

runs ``python -m bench_lib.launch.worker ...`` in a forked process (``runpy``) with its output
appended to the files (``stderr`` empty: with stdout), in process group ``group`` (-1: the
server's, 0: a new one it leads, else that one). Server to runner
(stdout): ``{"ready": PID, "mirrors_memory": B}`` once the imports are done (``B``: whether
each child maps the server's resident library pages, so that its memory reads as a fresh
interpreter's, ``resident_file_ranges``); ``{"started": PID}`` for each
request, in order; ``{"exited": PID, "code": C, "cpu_s": S}`` as each rank is reaped
(``code`` as ``Popen.returncode`` reads it: negative for a signal; ``cpu_s``: the process's
user + system CPU, its own reaped children included, from ``wait4``). The server exits when
its stdin closes, killing any child still running; it asks to die with the runner, and a
worker (told the server's pid) to die with the server (``lifeline.die_with_parent``), so no
rank outlives the runner. The FLOP peak probe and the collective micro-benchmark start
through the server too: every process a run starts after its first is a fork.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import select
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from bench_lib.processes.lifeline import EXIT_ORPHANED, die_with_parent, exit_lightly
from bench_lib.processes.resident_pages import mirror_resident, resident_file_ranges

POLL_S = 0.02
"""How often the server reaps its ranks while no request comes."""


def _redirect(fd: int, path: str, flags: int) -> None:
    target = os.open(path, flags, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _child(request: dict[str, Any], server_pid: int,
           resident: Sequence[tuple[int, int]]) -> None:
    """In the forked process: the server's resident library pages mapped as its own
    (``mirror_resident``), tied to the server (``die_with_parent``), its process group,
    stdin from /dev/null, stdout and stderr to the files asked for, then the module run as
    ``python -m`` runs it (``runpy``, as ``__main__``, with its arguments in ``sys.argv``);
    never returns (``os._exit``: the server's own ``finally`` blocks and atexit handlers are
    not the child's to run)."""
    code = 1
    try:
        mirror_resident(resident)
        if not die_with_parent(server_pid):
            code = EXIT_ORPHANED
            return
        if request["group"] >= 0:
            os.setpgid(0, request["group"])
        append = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        _redirect(0, os.devnull, os.O_RDONLY)
        _redirect(1, request["stdout"], append)
        _redirect(2, request["stderr"] or request["stdout"], append)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh python
        sys.argv = [request["module"], *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _send(message: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _reap(children: set[int]) -> None:
    """Report every rank that has ended, without blocking."""
    while children:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _send({"exited": pid, "code": os.waitstatus_to_exitcode(status),
               "cpu_s": usage.ru_utime + usage.ru_stime})


def serve(runner_pid: int, warm: Sequence[str]) -> int:
    """Import ``warm`` (what a rank needs), say ready, then fork a rank per request until
    stdin ends."""
    if not die_with_parent(runner_pid):
        return EXIT_ORPHANED
    # Ctrl-C is the runner's to handle (it then closes our stdin); the server sits in a
    # process group of its own, but a signal sent to it by pid must not leave it half-done.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for module in warm:
        importlib.import_module(module)
    # The imports' objects live as long as every rank: frozen (gc.freeze, as CPython's docs
    # advise before forking), a rank's collections (the worker's after its model build,
    # automatic ones) walk only its own objects and never write, so never copy, the pages
    # it shares with the server: 0.16 s of a ResNet50 launch's model build was that walk.
    gc.collect()
    gc.freeze()

    server_pid = os.getpid()
    children: set[int] = set()
    resident = resident_file_ranges()
    _send({"ready": server_pid, "mirrors_memory": resident is not None})
    pending = b""
    stdin = sys.stdin.fileno()
    try:
        while True:
            _reap(children)
            readable, _, _ = select.select([stdin], [], [], POLL_S)
            if not readable:
                continue
            chunk = os.read(stdin, 65536)
            if not chunk:
                return 0
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request, server_pid, resident or [])
                if request["group"] >= 0:  # here too, as shells do: the group exists
                    os.setpgid(pid, request["group"] or pid)  # before the next rank joins
                children.add(pid)
                _send({"started": pid})
    finally:
        for pid in children:  # the runner is done with them
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass



if __name__ == "__main__":
    exit_lightly(serve(int(sys.argv[1]), sys.argv[2:]))
