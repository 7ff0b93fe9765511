"""The runner's side of the fork server: one process per run imports torch and the
worker's modules once (the modules its caller names: ``ForkServer(warm)``), then forks every
rank of every launch. The server's own process is ``forkserver_process`` (its docstring
holds the protocol); this side starts it (``ForkServer``, ``prestart``), asks it for
processes and reads them as ``Popen``s (``Forked``, ``start_module``). Torch-free.

Why: a rank started as ``python -m bench_lib.launch.worker`` spends about 2.8 s of CPU (2-core
AMD EPYC) importing torch, torchvision and this library before it builds its model, once
per rank and per launch: with three launches of every case that was about a third of
``make bench``. A forked rank starts in milliseconds and is still a fresh process of its
own: its own address space (the server's imported pages, copy-on-write), allocator,
threads, pinning and process group, exactly as a spawned one, and its resident memory reads
as a spawned one's (``resident_pages``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

SERVER_MODULE = "bench_lib.processes.forkserver_process"
"""The server's own process, started as ``python -m SERVER_MODULE RUNNER_PID WARM...``."""
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
        server could list its resident library pages
        (``resident_pages.resident_file_ranges``), which each child maps as its own. Where
        not, memory-reading launches (cases) should not fork. Starts the server if none is
        running."""
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
        by these polls (``launch.ranks.combine``); a late one would blame the peer whose
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

