"""The fork server (processes/forkserver.py, forkserver_process.py, resident_pages.py): ranks
forked from one process that imported torch.

The premise (a server with no thread of its own to inherit half-alive), real cases through
it, exit codes as ``Popen`` reads them, process groups, CPU accounting, and a server that
dies.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import time
from pathlib import Path

import pytest

from bench_lib.launch.agent import WARM_MODULES, WORKER_MODULE
from bench_lib.launch.protocol import CaseSpec
from bench_lib.processes import forkserver, resident_pages
from bench_lib.processes.forkserver import ForkServer, start_module
from bench_lib.processes.lifeline import EXIT_ORPHANED
from bench_lib.processes.supervision import kill_group
from bench_lib.run.case_launch import LaunchOptions, run_case
from bench_lib.sweep.cases import new_case
from bench_lib.sweep.profile import Measurement

MEASUREMENT = Measurement(warmup_steps=1, timed_steps=3, max_time_s=30, case_timeout_s=120)


pytestmark = pytest.mark.integration  # every test here starts processes: the server, ranks


@pytest.fixture(scope="module")
def server():
    with ForkServer(WARM_MODULES) as s:
        yield s


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux's /proc")
def test_the_server_starts_no_thread_of_its_own(monkeypatch):
    """Forking is safe only from a process whose threads know about it: torch's imports
    must start none (no intra-op pool, no CUDA context). numpy's OpenBLAS starts its pool
    at import and stops it around a fork itself (pthread_atfork): held to one thread here,
    what is left is ours."""
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    with ForkServer(WARM_MODULES) as s:
        assert _threads(s.ensure()) == 1


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_a_case_runs_through_the_server_and_its_cpu_is_counted(strategy, server, cpu_rig,
                                                               tmp_path):
    case = new_case(cpu_rig, strategy, "toy", 32, 4, measurement=MEASUREMENT)
    before = server.reaped_cpu_s
    outcome = run_case(CaseSpec(case, cpu_rig), tmp_path, options=LaunchOptions(server=server))
    assert outcome.status == "ok", outcome.reason
    assert len(outcome.step_times_s) == 3
    # Every rank's CPU came back through the server: at least its timed steps' CPU.
    timed_cpu = sum(sum(t) for t in outcome.rank_step_cpu_times_s.values())
    assert server.reaped_cpu_s - before >= timed_cpu > 0
    assert outcome.machine_load is not None


@pytest.mark.timeout(120)
def test_a_rank_killed_by_a_signal_reads_as_popen_does(server, cpu_rig, tmp_path, monkeypatch):
    """The fault reads its variable in the rank, which inherits the server's environment:
    so a server of its own, started with the variable set."""
    monkeypatch.setenv("PARABENCH_TEST_FAULT", "ddp:1:sigkill")
    case = new_case(cpu_rig, "ddp", "toy", 32, 4, measurement=MEASUREMENT)
    with ForkServer(WARM_MODULES) as faulty:
        outcome = run_case(CaseSpec(case, cpu_rig), tmp_path,
                           options=LaunchOptions(server=faulty))
    assert outcome.status == "error"
    assert "rank 1 was killed by SIGKILL" in outcome.reason


def _worker(server: ForkServer, spec: Path, log: Path, group: int = 0):
    return server.spawn(WORKER_MODULE, [str(spec), "0", str(server.ensure())], log, group=group)


def test_exit_code_and_log_of_a_rank_that_fails(server, tmp_path):
    log = tmp_path / "worker.log"
    rank = _worker(server, tmp_path / "no-such-spec.json", log)
    assert rank.wait(timeout=60) == 1
    assert rank.poll() == rank.returncode == 1
    assert "no-such-spec.json" in log.read_text()


def test_a_module_runs_as_python_m_runs_it(server, tmp_path):
    """``sys.argv``, ``__main__``, stdout and stderr apart, and ``sys.exit``'s code."""
    out, err = tmp_path / "out", tmp_path / "err"
    proc = start_module(server, "bench_lib.launch.agent", ["1", "spec.json"], out, err)
    # lifeline's main with a runner pid that is not its parent: "the runner is gone".
    assert proc.wait(timeout=60) == EXIT_ORPHANED
    assert "the runner is gone" in err.read_text() and out.read_text() == ""


def test_a_rank_inherits_frozen_imports_and_may_start_cuda(server, tmp_path):
    """Its collections walk only its own objects (``serve``: gc.freeze after the imports),
    and CUDA, never started in the server, may start in it: a cuda rig's ranks are forked
    too. On a GPU box the probe starts CUDA for real."""
    out = tmp_path / "out"
    proc = start_module(server, "tests.fork_probe", [], out, tmp_path / "err")
    assert proc.wait(timeout=120) == 0, (tmp_path / "err").read_text()
    found = json.loads(out.read_text())
    assert found["frozen"] > 100_000  # torch's and torchvision's objects, at least
    assert found["bad_fork"] is False
    assert found.get("cuda_initialised", True) is True


def _hang(server: ForkServer, tmp_path: Path, group: int = 0):
    """A rank that sleeps: the spec is a fifo nobody writes, so reading it blocks."""
    fifo = tmp_path / f"spec{group}.fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    return _worker(server, fifo, tmp_path / "worker.log", group)


def test_ranks_share_the_first_ranks_process_group(server, tmp_path):
    first = _hang(server, tmp_path)
    second = _hang(server, tmp_path, group=first.pid)
    assert os.getpgid(first.pid) == os.getpgid(second.pid) == first.pid
    assert first.poll() is None and second.poll() is None
    kill_group(first.pid)
    assert first.wait(timeout=30) == second.wait(timeout=30) == -signal.SIGKILL


def test_a_server_that_dies_takes_its_ranks_and_the_next_spawn_starts_another(tmp_path):
    with ForkServer(WARM_MODULES) as s:
        rank = _hang(s, tmp_path)
        old = s.ensure()
        os.kill(old, signal.SIGKILL)
        assert rank.wait(timeout=30) == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{rank.pid}") and time.monotonic() < deadline:
            try:  # the rank's parent-death signal; a zombie until init reaps it
                if open(f"/proc/{rank.pid}/stat").read().split()[2] == "Z":
                    break
            except OSError:
                break
            time.sleep(0.05)
        else:
            assert not os.path.exists(f"/proc/{rank.pid}"), "the rank outlived its server"
        failing = _worker(s, tmp_path / "missing.json", tmp_path / "worker.log")
        assert s.ensure() != old
        assert failing.wait(timeout=60) == 1


def test_a_server_first_used_from_a_short_lived_thread_outlives_it(tmp_path):
    """The parent-death signal fires when the thread that started the server ends: a pool
    thread's first spawn (parity's side-by-side runs) must not be that thread."""
    import threading

    with ForkServer(WARM_MODULES) as s:
        pid: list[int] = []
        thread = threading.Thread(target=lambda: pid.append(s.ensure()))
        thread.start()
        thread.join()
        time.sleep(0.5)  # a signal tied to the thread would have killed it by now
        assert s.ensure() == pid[0]
        assert _worker(s, tmp_path / "missing.json", tmp_path / "worker.log").wait(60) == 1


def _rss_file_kib() -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines()
                     if line.startswith("RssFile:")))


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="needs Linux's /proc")
@pytest.mark.parametrize("advice", [resident_pages.MADV_POPULATE_READ, -1],
                         ids=["madvise", "byte-reads"])
def test_a_forked_child_maps_the_file_pages_its_parent_had_resident(tmp_path, monkeypatch,
                                                                    advice):
    """``fork`` leaves a file mapping the parent only read out of the child's page tables,
    so a forked rank's resident memory would read ~300 MiB (the libraries) below a fresh
    interpreter's; ``mirror_resident`` maps back what ``resident_file_ranges`` listed.
    Advice -1: a kernel without MADV_POPULATE_READ (madvise fails), one read per page."""
    monkeypatch.setattr(resident_pages, "MADV_POPULATE_READ", advice)
    size = 32 * 2**20
    data = tmp_path / "mapped.bin"
    data.write_bytes(os.urandom(size))
    with data.open("rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapped:
        for page in range(0, size, 2 * resident_pages.PAGE):  # half its pages resident
            mapped[page]
        ranges = resident_pages.resident_file_ranges()
        # Read beside the listing: a kernel that reclaims cold pages on its own (DAMON) can
        # take some of this process's out of its page tables while the child runs.
        parent = _rss_file_kib()
        assert ranges is not None
        listed = sum(length for address, length in ranges)
        assert listed >= size // 2  # the mapping's touched half, and the libraries'
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no torch, no pytest; its RssFile before and after
            before = _rss_file_kib()
            resident_pages.mirror_resident(ranges)
            os.write(write, f"{before} {_rss_file_kib()}".encode())
            os._exit(0)
        os.close(write)
        before, after = map(int, os.read(read, 100).split())
        os.waitpid(pid, 0)
    half_kib = size // 2 // 1024
    assert parent - before >= half_kib  # the premise: fork left them out
    # Mirrored: the parent's resident set. Not to the page: the child also faults in what its
    # own code runs (ctypes, the madvise call), more in a test worker that has imported much
    # (4.8 MiB over the parent in a full suite); mapping the untouched half too would be 16.
    assert -half_kib // 4 < after - parent < half_kib // 2


class _LateReports:
    """A server whose report of an exit has not arrived unless one waits for it."""

    def __init__(self) -> None:
        self.waited: list[float | None] = []

    def exit_code(self, pid: int, timeout_s: float | None = 0.0) -> int | None:
        self.waited.append(timeout_s)
        return -signal.SIGKILL if timeout_s else None


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux's /proc")
def test_poll_sees_a_dead_rank_before_the_servers_report_arrives():
    """A rank's end must be seen when it happens (the runner blames the rank that ended
    first: a late report would blame the peer whose collective failed because of it)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        server = _LateReports()
        rank = forkserver.Forked(proc.pid, server)  # type: ignore[arg-type]
        assert rank.poll() is None and server.waited == [0.0]  # running: no wait
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10  # a zombie: its parent (we) has not reaped it
        while not forkserver._ended(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rank.poll() == -signal.SIGKILL
        assert server.waited[-1] == forkserver.REPORT_WAIT_S
    finally:
        proc.kill()
        proc.wait()
    assert forkserver._ended(proc.pid)  # reaped: gone


def test_a_forking_command_gets_the_server_started_before_its_imports(tmp_path, monkeypatch):
    monkeypatch.setattr(forkserver, "_prestarted", None)
    forkserver.prestart(["report", "results/x"], WARM_MODULES)  # forks nothing: no server
    assert forkserver._prestarted is None
    forkserver.prestart(["run", "--profile", "smoke"], WARM_MODULES)
    early = forkserver._prestarted
    assert early is not None and not early._gone  # starting already
    with ForkServer.take(WARM_MODULES) as server:
        assert server is early and forkserver._prestarted is None  # taken once
        assert ForkServer.take(WARM_MODULES) is not early
        rank = start_module(server, "bench_lib.launch.agent", ["1", "spec.json"],
                            tmp_path / "out")
        assert rank.wait(timeout=60) == EXIT_ORPHANED
