"""The FLOP peak probe and the collective micro-benchmark die with the process that started
them (#28 item 6): a runner killed with SIGKILL must not leave them holding devices (the
probe waits up to 300 s at its barrier, a collectives rank 120 s at its rendezvous).

Each test starts a parent that runs the instrument as the runner does, with one of its two
processes never started, so that the other waits (at the probe's first barrier, at the
process group's rendezvous) as a process whose runner died mid-measurement would; the parent
is then SIGKILLed and the child must go. Two paths: without a fork server (a fresh
interpreter, ``processes.forkserver.start_module`` with ``server=None``) and forked by one
(the run's path: the server ties each child to itself, and itself to the runner).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import PYTHON, REPO

PARENT = """
import json, sys
from types import SimpleNamespace
from bench_lib.measure import collectives, flop_peak, flop_probe
from bench_lib.processes.forkserver import ForkServer
from bench_lib.rig import Rig
from bench_lib.launch.agent import WARM_MODULES

instrument, forked = sys.argv[1], sys.argv[2] == "forked"
module = flop_peak if instrument == "flops" else collectives
real = module.start_module
never = SimpleNamespace(pid=0, returncode=None, poll=lambda: None, kill=lambda: None,
                        wait=lambda *a, **k: 0)

def first_only(server, name, args, *rest, **kwargs):
    # The second device's process never starts: the first waits for it.
    index = args[5] if instrument == "flops" else args[1]
    return real(server, name, args, *rest, **kwargs) if index == "0" else never

module.start_module = first_only
rig = Rig.from_dict(json.loads(sys.argv[3]))
server = ForkServer(WARM_MODULES) if forked else None
if instrument == "flops":
    flop_peak.measure_peak(rig, ["fp32"], n=32, min_time_s=0.01, conv=flop_probe.ConvShape(1, 4, 8),
                           server=server)
else:
    collectives.measure(rig, (1.0,), repeats=1, timeout_s=300, server=server)
"""
FOLDER = {"flops": "parabench-peak-", "collectives": "parabench-coll-"}
WAITING = {"flops": "fp32-gemm-0-start.0", "collectives": "rendezvous"}
"""The file whose presence says the first process waits for the second (torch imported)."""


def _instrument_child(parent: psutil.Process,
                      instrument: str) -> tuple[psutil.Process, Path] | None:
    """The instrument's process under ``parent`` and its temporary folder, found by the
    output file it writes there (a forked process's command line is the fork server's)."""
    for p in parent.children(recursive=True):
        try:
            files = p.open_files()
        except psutil.Error:
            continue
        for f in files:
            if FOLDER[instrument] in f.path:
                return p, Path(f.path).parent
    return None


def _gone(process: psutil.Process, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(180)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.integration
@pytest.mark.parametrize("instrument", ["flops", "collectives"])
@pytest.mark.parametrize("path", ["fresh", "forked"])
def test_an_instrument_dies_when_its_runner_is_sigkilled(cpu_rig, instrument, path, tmp_path):
    # The SIGKILLed runner cannot remove its temporary folder: keep it in pytest's, not /tmp.
    parent = subprocess.Popen([PYTHON, "-c", PARENT, instrument, path,
                               json.dumps(cpu_rig.as_dict())], cwd=REPO,
                              env={**os.environ, "TMPDIR": str(tmp_path)})
    child = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and parent.poll() is None:
            found = _instrument_child(psutil.Process(parent.pid), instrument)
            if found is not None and (found[1] / WAITING[instrument]).exists():
                child = found[0]
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"the {instrument} process never reached its wait "
                        f"(parent exit code {parent.poll()})")
        assert child is not None
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _gone(child, 15), f"the {instrument} process outlived its SIGKILLed runner"
    finally:
        parent.kill()
        parent.wait()
        if child is not None:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
