"""Shared fixtures: small workloads, a CPU rig, GPU skips, the repo's python, and one tiny
real run that several test files read."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import fcntl
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from bench_lib import rig_detection
from bench_lib.fault_hooks import QUICK_PEAK_ENV
from bench_lib.prediction.kept_counts import CACHE_ENV
from bench_lib.rig import Rig
from bench_lib.topology import available_cores

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
# Every run a test starts probes the FLOP peak briefly (recorded in env.json's test_hooks):
# tests read no MFU anyone bets on. Tests of the probe itself pass their own time.
os.environ.setdefault(QUICK_PEAK_ENV, "1")


@contextlib.contextmanager
def _module_argv(args: Sequence[str]) -> Iterator[None]:
    """``sys.argv`` as ``python -m bench_lib ARGS`` sets it (env.json records it), then back."""
    argv = sys.argv
    sys.argv = [str(REPO / "bench_lib" / "__main__.py"), *args]
    try:
        yield
    finally:
        sys.argv = argv


@contextlib.contextmanager
def _kept_affinity_and_threads() -> Iterator[None]:
    """This process's CPU affinity and torch's threads as they were, whatever pinning runs
    inside (pin_worker, peak measurement, a run in this process)."""
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        if cores is not None:
            os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)


def in_process(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m bench_lib ARGS`` run in this process (``commands.main``), as a finished process:
    the same exit code, stdout and stderr without a fresh interpreter's imports (about 3 s of
    CPU a call on 2 cores). For the tests whose subject is not the process itself (signals,
    the module entry point, several runs at once: those start one)."""
    from bench_lib import commands

    capsys.readouterr()  # what the test printed before is not the command's
    with _module_argv(args):
        try:
            code = commands.main(list(args))
        except SystemExit as stop:  # argparse's refusals
            code = stop.code if isinstance(stop.code, int) else 2
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["python", "-m", "bench_lib", *args], code, out, err)


def pytest_configure(config):
    """The session's own folder for the counts kept on disk (``prediction.kept_counts``),
    made by the controlling process before its workers start (they inherit it, as does
    every process a test starts): one test's fake step serves the next, as one user's run
    serves their next, and nothing is read from or left in the user's cache."""
    if not hasattr(config, "workerinput"):
        config.parabench_cache = tempfile.mkdtemp(prefix="parabench-test-cache-")
        os.environ[CACHE_ENV] = config.parabench_cache


def pytest_unconfigure(config):
    if hasattr(config, "parabench_cache"):
        shutil.rmtree(config.parabench_cache, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    skip_multi = pytest.mark.skip(reason=f"needs 2 CUDA GPUs; {gpus} visible")
    for item in items:
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(skip_gpu)
        if "multi_gpu" in item.keywords and gpus < 2:
            item.add_marker(skip_multi)
    # The longest first (slow, then integration), so that under `make test`'s workers the
    # unit tests fill the gaps at the end instead of one minute-long test running alone.
    items.sort(key=lambda item: 0 if "slow" in item.keywords
               else 1 if "integration" in item.keywords else 2)


@pytest.fixture(autouse=True)
def _restore_affinity_and_threads():
    """Undo any pinning a test does in this process (pin_worker, peak measurement, ...).

    Subprocesses inherit the affinity, so a leak would shrink every later CLI run's rig.
    """
    with _kept_affinity_and_threads():
        yield


@pytest.fixture
def restore_math_flags() -> Iterator[None]:
    """Undo a test's change of the TF32 and cuDNN benchmark flags (``math_modes.set_math_mode``):
    they are process-wide, and a later test would compute in that mode."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    before = (matmul.allow_tf32, cudnn.allow_tf32, cudnn.benchmark)
    yield
    matmul.allow_tf32, cudnn.allow_tf32, cudnn.benchmark = before


@pytest.fixture(scope="session")
def forks():
    """One fork server for the session's in-process cases
    (``run_case(..., options=LaunchOptions(server=forks))``): their ranks start without
    seconds of imports each. Its environment is the session's at
    its start: a test that sets a fault variable runs its case without it (the fresh
    interpreters of ``server=None``)."""
    from bench_lib.launch.agent import WARM_MODULES
    from bench_lib.processes.forkserver import ForkServer

    with ForkServer(WARM_MODULES) as server:
        yield server


@pytest.fixture
def cpu_rig() -> Rig:
    """A 2-worker cpu rig that shares whatever cores exist (tests never need real cores)."""
    cores = available_cores()
    return Rig("cpu", 2, 1, tuple((cores * 2)[:2]))


@pytest.fixture
def visible_gpus(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """``visible_gpus(n)``: the rig's detection in this process
    (``rig_detection.cuda_device_count``: the default rig, ``--rig cuda``, a help page's
    default profile) sees ``n`` CUDA GPUs, whatever this machine has. A test then says the
    machine it means: one that asks for the cpu rig shows it still gets it on a GPU box, one
    about a machine without GPUs makes that true itself. Processes the test starts see the
    machine's own GPUs."""
    def see(n: int) -> None:
        monkeypatch.setattr(rig_detection, "cuda_device_count", lambda: n)

    return see


# --- One tiny real run, read by several test files --------------------------------------------

SHARED_RUN = ["run", "--profile", "smoke", "--rig", "cpu", "--models", "resnet-tiny",
              "--image-sizes", "32", "--batch-sizes", "4", "--strategies", "single,ddp",
              "--warmup-steps", "1", "--timed-steps", "2", "--launches", "2", "--predict",
              "--report"]
"""Two rounds of one workload, predicted and reported: test_provisional_rows reads its
rounds and interim report, test_predict_time its calibration (each once started its own)."""


@dataclasses.dataclass(frozen=True)
class SharedRun:
    """``python -m bench_lib SHARED_RUN --out OUT`` as it ended, and what each interim report
    showed when it was written: (when, cases.csv's rows then, report.html then)."""

    out: Path
    returncode: int
    stdout: str
    stderr: str
    interim: list[tuple[str, list[dict[str, str]], str]]

    @property
    def run_dir(self) -> Path:
        (run_dir,) = [p for p in self.out.iterdir() if not p.is_symlink()]
        return run_dir


def _record_shared_run(folder: Path) -> None:
    """Run ``SHARED_RUN`` in this process into ``folder``/out and write what it printed and
    its interim reports to ``folder``/run.json."""
    from bench_lib import commands
    from bench_lib.commands import run as run_command

    interim: list[tuple[str, list[dict[str, str]], str]] = []
    report = run_command.interim_report

    def report_then_look(run_dir: Path, when: str) -> str:
        line = report(run_dir, when)
        with (run_dir / "cases.csv").open(newline="") as f:
            rows = list(csv.DictReader(f))
        interim.append((when, rows, (run_dir / "report.html").read_text()))
        return line

    out, err = io.StringIO(), io.StringIO()
    # As in_process runs a command, and undoing its pinning as _restore_affinity_and_threads
    # does (a session fixture is set up outside any test's).
    with _module_argv(SHARED_RUN), _kept_affinity_and_threads(), \
            pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        patch.setattr(run_command, "interim_report", report_then_look)
        code = commands.main([*SHARED_RUN, "--out", str(folder / "out")])
    (folder / "run.json").write_text(json.dumps({
        "returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue(),
        "interim": interim}))


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> SharedRun:
    """``SHARED_RUN``, run once for the whole session: under pytest-xdist the first worker to
    ask runs it under a lock in the workers' common temporary folder, the other reads it
    (pytest-xdist's "making session-scoped fixtures execute only once")."""
    base = tmp_path_factory.getbasetemp()
    folder = (base if worker_id == "master" else base.parent) / "shared-run"
    folder.mkdir(exist_ok=True)
    with (folder / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "run.json").exists():
            _record_shared_run(folder)
    saved = json.loads((folder / "run.json").read_text())
    return SharedRun(folder / "out", saved["returncode"], saved["stdout"], saved["stderr"],
                     [(when, rows, html) for when, rows, html in saved["interim"]])
