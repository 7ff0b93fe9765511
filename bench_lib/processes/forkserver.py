"""A fork server for the local launcher: one process per run imports torch and the worker's
modules once (the modules its caller names: ``ForkServer(warm)``), then forks every rank of
every launch.

    python -m bench_lib.processes.forkserver RUNNER_PID [MODULE ...]

Why: a rank started as ``python -m bench_lib.run.worker`` spends about 2.8 s of CPU (2-core
AMD EPYC) importing torch, torchvision and this library before it builds its model, once
per rank and per launch: with three launches of every case that was about a third of
``make bench``. A forked rank starts in milliseconds and is still a fresh process of its
own: its own address space (the server's imported pages, copy-on-write), allocator,
threads, pinning and process group, exactly as a spawned one, and its resident memory reads
as a spawned one's (``resident_file_ranges``). That holds because the server
never runs a torch operation: no intra-op thread pool, no OpenMP runtime, no CUDA context
exists in it to be inherited half-alive (forking after any of these is unsafe, which is
why the server is a process of its own rather than the runner, which has threads). The one
thread pool its imports start is numpy's OpenBLAS, which stops it around a fork itself
(``pthread_atfork``; tests/test_forkserver.py checks that nothing else runs).

The modules to import before forking come on the command line (``MODULE ...``): the
caller says what its ranks run (the runner: ``run.agent.WARM_MODULES``), so that this
module names nothing of the library it serves.

Protocol, one JSON object per line. Runner to server (stdin)::

    {"module": "bench_lib.run.worker", "args": ["/run/.work/case/spec.json", "1", "4100"],
     "stdout": ".../worker.log", "stderr": "", "group": 4242}

runs ``python -m bench_lib.run.worker ...`` in a forked process (``runpy``) with its output
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
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench_lib.processes.lifeline import EXIT_ORPHANED, die_with_parent, exit_lightly

POLL_S = 0.02
"""How often the server reaps its ranks while no request comes."""
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MADV_POPULATE_READ = 22
"""Linux 5.14+: map a range's pages into the page tables as a read of each would."""
PAGEMAP_PRESENT = 1 << 63
"""/proc/self/pagemap: the page is in this process's page tables (readable unprivileged)."""


def resident_file_ranges(proc: Path = Path("/proc/self")) -> list[tuple[int, int]] | None:
    """The (address, length) runs of this process's file-backed mappings (libraries, mapped
    files) that are in its page tables, so counted in its resident set (``RssFile``); None
    where /proc cannot tell.

    Why: ``fork`` does not copy the page tables of a file mapping the parent never wrote
    (the kernel refaults such pages from the page cache on demand), so a forked rank starts
    with ~300 MiB less resident memory than a fresh interpreter that imported the same
    libraries (ResNet50 on a cpu rig: gross peak ~780 against ~1054 MiB), then faults in,
    during its steps, library pages a fresh rank counted before its baseline (net peak ~5%
    higher). ``mirror_resident`` in the child puts them back: its memory reads as a fresh
    rank's.
    """
    ranges: list[tuple[int, int]] = []
    try:
        with open(proc / "maps") as maps, open(proc / "pagemap", "rb") as pagemap:
            for line in maps:
                fields = line.split(maxsplit=5)
                # address perms offset dev inode path: a file has an inode; [vdso] and
                # the like have none, anonymous memory neither (fork copies it anyway).
                if len(fields) < 6 or fields[4] == "0" or fields[5].startswith("["):
                    continue
                low, high = (int(x, 16) for x in fields[0].split("-"))
                pages = (high - low) // PAGE
                pagemap.seek(low // PAGE * 8)
                entries = memoryview(pagemap.read(pages * 8)).cast("Q")
                start = None
                for i in range(len(entries)):
                    present = entries[i] & PAGEMAP_PRESENT
                    if present and start is None:
                        start = i
                    elif not present and start is not None:
                        ranges.append((low + start * PAGE, (i - start) * PAGE))
                        start = None
                if start is not None:
                    ranges.append((low + start * PAGE, (len(entries) - start) * PAGE))
    except (OSError, ValueError):
        return None
    return ranges


def mirror_resident(ranges: Sequence[tuple[int, int]]) -> None:
    """Map ``ranges`` (``resident_file_ranges`` of the parent) into this process's page
    tables: ``madvise(MADV_POPULATE_READ)``, or a read of one byte per page where the kernel
    is older than 5.14. Only pages already in the page cache: it reads no file."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for address, length in ranges:
        if libc.madvise(address, length, MADV_POPULATE_READ) != 0:
            for page in range(address, address + length, PAGE):
                ctypes.c_char.from_address(page).value  # noqa: B018  the read maps it


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


SERVER_MODULE = "bench_lib.processes.forkserver"
START_TIMEOUT_S = 300.0
"""How long the runner waits for the server's imports (seconds of CPU on a loaded machine)."""


class ServerGone(RuntimeError):
    """The fork server ended (or never became ready): its ranks are gone with it."""


class ForkServer:
    """The runner's side: starts the server (with the first ``spawn``), forks processes
    through it (``spawn``, from any thread), and reads their exits. One per run; a server
    that died is started again on the next ``spawn``.

    ``warm``: the modules the server imports before it forks anything (a case's worker, and
    with it torch, torchvision, the strategies and the workloads, which every process it
    forks then finds imported). Named by the caller and imported only in the server's own
    process, so that this side stays torch-free.

    ``reaped_cpu_s``: the CPU time of every rank reaped so far, which the runner counts as
    its own children's (``contention.CpuSnapshot``): the ranks are the server's children,
    so ``RUSAGE_CHILDREN`` no longer sees them.
    """

    def __init__(self, warm: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        self.warm = tuple(warm)
        self._env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        self._cond = threading.Condition()
        self._spawning = threading.Lock()
        self._exits: dict[int, int] = {}
        self._started: list[int] = []
        self._live: set[int] = set()
        self.reaped_cpu_s = 0.0
        self._mirrors = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._gone = True
        self._attempt: tuple[list[subprocess.Popen[bytes]], list[int], list[BaseException]]
        self._attempt = ([], [], [])
        """The latest start's server process, its ready pid, its failure (``_serve``)."""

    def __enter__(self) -> ForkServer:
        return self  # started by the first ``spawn`` (or ``ensure``): none where none is

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the server if none is running, without waiting for its imports (``ensure``
        waits): started first, it imports torch while its command does the same.

        The server is started by its reader thread, which lives exactly as long as the
        server: the parent-death signal the server asks for fires when the *thread* that
        started it ends (prctl's rule), so a caller's short-lived thread (a pool's) must
        not be the one.
        """
        with self._cond:
            if not self._gone:
                return
            self._gone = False
            self._proc = None
            self._attempt = ([], [], [])
            threading.Thread(target=self._serve, args=self._attempt, daemon=True,
                             name="forkserver").start()

    def _ensure(self) -> None:
        """Start the server if none is running, and wait for its imports (``ensure``)."""
        self.start()
        with self._cond:
            started, ready, failed = self._attempt
            self._cond.wait_for(lambda: ready or self._gone, START_TIMEOUT_S)
            if ready:
                return
        if started:
            started[0].kill()
            started[0].wait()
        with self._cond:
            self._gone = True
        code = started[0].returncode if started else None
        why = f": {failed[0]}" if failed else f" (exit code {code})"
        raise ServerGone(f"the fork server did not start{why}")

    @classmethod
    def take(cls, warm: Sequence[str]) -> ForkServer:
        """The server ``prestart`` started for this process's command (once), where it warms
        ``warm``; else a new one that does."""
        global _prestarted
        server, _prestarted = _prestarted, None
        if server is not None and server.warm != tuple(warm):
            server.close()
            server = None
        return server or cls(warm)

    def _serve(self, started: list[subprocess.Popen[bytes]], ready: list[int],
               failed: list[BaseException]) -> None:
        """The server's thread: start it, then read every message until its stdout
        closes."""
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", SERVER_MODULE, str(os.getpid()), *self.warm],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self._env, process_group=0)
        except OSError as e:
            with self._cond:
                failed.append(e)
                self._gone = True
                self._cond.notify_all()
            return
        with self._cond:
            started.append(proc)
            self._proc = proc
        assert proc.stdout is not None
        for line in proc.stdout:
            message = json.loads(line)
            with self._cond:
                if "ready" in message:
                    ready.append(message["ready"])
                    self._mirrors = bool(message.get("mirrors_memory"))
                elif "started" in message:
                    self._started.append(message["started"])
                    self._live.add(message["started"])
                elif "exited" in message:
                    self._exits[message["exited"]] = message["code"]
                    self._live.discard(message["exited"])
                    self.reaped_cpu_s += message["cpu_s"]
                self._cond.notify_all()
        proc.wait()
        with self._cond:
            if self._proc is proc:  # not an earlier server's thread, ending late
                # Its ranks died with it (their parent-death signal).
                for pid in self._live:
                    self._exits.setdefault(pid, -signal.SIGKILL)
                self._live.clear()
                self._gone = True
            self._cond.notify_all()

    def ensure(self) -> int:
        """Start the server if none is running; its pid (its children's parent)."""
        with self._spawning:
            self._ensure()
        assert self._proc is not None
        return self._proc.pid

    def mirrors_memory(self) -> bool:
        """Whether a forked process's resident memory reads as a fresh interpreter's: the
        server could list its resident library pages (``resident_file_ranges``), which each
        child maps as its own. Where not, memory-reading launches (cases) should not fork.
        Starts the server if none is running."""
        self.ensure()
        return self._mirrors

    def spawn(self, module: str, args: Sequence[str], stdout: Path,
              stderr: Path | None = None, group: int = -1) -> Forked:
        """Fork a process that runs ``python -m MODULE ARGS...`` without the interpreter's
        start and imports: output appended to ``stdout`` (and ``stderr``, default the same
        file); in process group ``group`` (-1: the server's; 0: a new one it leads; else
        that group, which must exist)."""
        request = {"module": module, "args": list(args), "stdout": str(stdout),
                   "stderr": str(stderr) if stderr else "", "group": group}
        with self._spawning:  # one request at a time: replies come back in order
            self._ensure()
            assert self._proc is not None and self._proc.stdin is not None
            with self._cond:
                count = len(self._started)
            try:
                self._proc.stdin.write((json.dumps(request) + "\n").encode())
                self._proc.stdin.flush()
            except OSError as e:
                raise ServerGone(f"the fork server is gone ({e})") from None
            with self._cond:
                self._cond.wait_for(lambda: len(self._started) > count or self._gone)
                if len(self._started) <= count:
                    raise ServerGone("the fork server ended before starting the process")
                return Forked(self._started[count], self)

    def exit_code(self, pid: int, timeout_s: float | None = 0.0) -> int | None:
        """``pid``'s exit code once reaped (waiting up to ``timeout_s``; None: forever)."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits, timeout_s)
            return self._exits.get(pid)

    def close(self) -> None:
        """End the server (its stdin closes; any rank still running is killed)."""
        proc = self._proc
        if proc is None:
            return
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._proc = None


_prestarted: ForkServer | None = None
FORKING_COMMANDS = ("run", "tune", "distance", "parity")
"""The CLI commands whose processes a fork server starts (``prestart``)."""


def prestart(argv: Sequence[str], warm: Sequence[str]) -> None:
    """Start the fork server of a command that will use one (``argv[0]`` in
    ``FORKING_COMMANDS``), warming ``warm``, before the command imports torch, so that both
    imports run at once (~2 s less per command on 2 cores); the command gets it from
    ``ForkServer.take``. Where the command ends without forking (a usage error, ``--help``),
    the server dies with this process."""
    global _prestarted
    if argv[:1] and argv[0] in FORKING_COMMANDS and _prestarted is None:
        _prestarted = ForkServer(warm)
        _prestarted.start()


def parent_pid(server: ForkServer | None) -> int:
    """The parent of a process ``start_module(server, ...)`` starts: the server (started if
    none runs), else this process. A child told it ties itself to it as it starts
    (``lifeline.die_with_parent``): through the server it dies with the server, which dies
    with the runner; a fresh interpreter has no other lifeline."""
    return server.ensure() if server is not None else os.getpid()


def start_module(server: ForkServer | None, module: str, args: Sequence[str], stdout: Path,
                 stderr: Path | None = None, group: int = -1) -> Forked | subprocess.Popen[bytes]:
    """Start ``python -m MODULE ARGS...``: forked by ``server`` where one is given, else a
    fresh interpreter (``Popen``; ``group`` as in ``ForkServer.spawn``). Either is read as
    a ``Popen`` is: ``pid``, ``poll()``, ``wait()``, ``returncode``."""
    if server is not None:
        return server.spawn(module, args, stdout, stderr, group)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with stdout.open("ab") as out, (stderr or stdout).open("ab") as err:
        return subprocess.Popen([sys.executable, "-m", module, *args], stdout=out, stderr=err,
                                env=env, process_group=None if group < 0 else group)


PROC_STAT = Path("/proc/self/stat")
REPORT_WAIT_S = 5.0
"""How long ``Forked.poll`` waits for the server's report of a process it saw end."""


def _ended(pid: int) -> bool:
    """Whether ``pid`` has ended: a zombie its parent has not reaped yet, or gone."""
    if not PROC_STAT.exists():  # no /proc: the server's report alone says
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:][:1] == b"Z"  # comm may hold spaces and ')'


class Forked:
    """A process the server forked, read like a ``subprocess.Popen``: ``pid``, ``poll()``,
    ``wait()``, ``kill()`` and ``returncode`` (negative: killed by that signal)."""

    def __init__(self, pid: int, server: ForkServer) -> None:
        self.pid = pid
        self._server = server
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once the process has ended, as promptly as ``Popen.poll``: a rank
        that died is a zombie (or, reaped, gone) before the server's report of it arrives,
        so that state waits for the report. The runner blames the rank that ended first
        by these polls (``run.ranks.combine``); a late one would blame the peer whose
        collective failed because of it."""
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        if self.returncode is None and _ended(self.pid):
            self.returncode = self._server.exit_code(self.pid, REPORT_WAIT_S)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0.0)
        return self.returncode


if __name__ == "__main__":
    exit_lightly(serve(int(sys.argv[1]), sys.argv[2:]))
