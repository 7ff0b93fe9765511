"""Two runners on this host as the two "nodes" of a multi-node run (issue #15).

Each node runs the same command with its own ``--node-rank`` and ``--out``, one cpu worker
each (pinned to its own core where there are two), gloo over loopback, torchrun's c10d
rendezvous and node 0's coordination store on free loopback ports. Node 0's run folder gets
every row; a node that dies mid-case is an error row there within the case timeout; Ctrl-C
on node 0 stops every node's ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import psutil
import pytest

from bench_lib.launch import torchrun
from bench_lib.launch.torchrun import Launcher
from bench_lib.nodes import coordination
from bench_lib.sweep.profile import UsageError
from tests.conftest import PYTHON, REPO, in_process
from tests.test_reliability import TINY, finish, only_run_dir, statuses

NODE = [*TINY, "--devices", "1", "--threads-per-worker", "1", "--launcher", "torchrun",
        "--nnodes", "2"]
QUICK_LOSS = """\
import runpy, sys
from bench_lib.nodes import coordination
coordination.LOST_AFTER_S, coordination.BYE_WAIT_S = 4.0, 1.0
sys.argv = ["bench_lib", *sys.argv[1:]]
runpy.run_module("bench_lib", run_name="__main__", alter_sys=True)
"""
"""``python -m bench_lib`` whose node 0 counts a node lost after 4 s without a heartbeat
instead of ``LOST_AFTER_S``, and waits 1 s for the others' goodbyes instead of ``BYE_WAIT_S``:
the test of a lost node waits out both, in seconds that test nothing else."""


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (held together while chosen, so they differ)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Cluster:
    """Two node runners of one multi-node run, sharing a rendezvous and a coordination port."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.rdzv, self.coord = free_ports(2)

    def out(self, node: int) -> Path:
        return self.root / f"node{node}"

    def start(self, node: int, *args: str, fault: str = "",
              quick_loss: bool = False) -> subprocess.Popen:
        entry = ["-c", QUICK_LOSS] if quick_loss else ["-m", "bench_lib"]
        cmd = [PYTHON, *entry, "run", *NODE, *args, "--node-rank", str(node),
               "--rdzv-endpoint", f"127.0.0.1:{self.rdzv}", "--coord-port", str(self.coord),
               "--out", str(self.out(node))]
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if len(cores) >= 2 and shutil.which("taskset"):  # a core of its own, as a node has
            cmd = ["taskset", "-c", str(cores[node]), *cmd]
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PARABENCH_TEST_FAULT=fault)
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def processes(self) -> list[psutil.Process]:
        """Live agents and ranks started for either node (their spec paths name the node's
        folder)."""
        found = []
        for p in psutil.process_iter(["cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if "bench_lib.launch.worker" in cmd and str(self.root) in cmd:
                found.append(p)
        return found

    def wait_gone(self, timeout: float = 15) -> list[psutil.Process]:
        deadline = time.monotonic() + timeout
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left


def _wait_for(paths: Callable[[], list[Path]], timeout: float = 200) -> None:
    deadline = time.monotonic() + timeout
    while not paths():
        assert time.monotonic() < deadline, "node 1's rank never started"
        time.sleep(0.5)


@pytest.mark.timeout(420)
@pytest.mark.slow  # 45-140 s on 2 cores: started first (conftest), not last
@pytest.mark.integration
def test_two_nodes_run_ddp_and_gpipe_into_node_0s_run_folder(tmp_path):
    cluster = Cluster(tmp_path)
    nodes = [cluster.start(i, "--strategies", "single,ddp,gpipe,mp") for i in (0, 1)]
    (code0, out0, err0), (code1, _, err1) = [finish(n, timeout=360) for n in nodes]
    assert code0 == 0, err0
    assert code1 == 0, err1
    run_dir = only_run_dir(cluster.out(0))
    assert out0.strip().splitlines()[-1] == str(run_dir)
    assert statuses(run_dir) == {"single": "ok", "ddp": "ok", "gpipe": "ok",
                                 "mp": "unsupported"}
    cases = pd.read_csv(run_dir / "cases.csv").set_index("strategy")
    assert cases["world_size"].to_dict() == {"single": 1, "ddp": 2, "gpipe": 2, "mp": 2}
    assert set(cases["rig"]) == {"cpu:1x1t@2nodes"}
    assert "cannot reach another node's" in cases.loc["mp", "reason"]
    assert cases.loc["ddp", "speedup_vs_single"] > 0  # against single on node 0
    # Both nodes' ranks' steps, and a timeline with each node's device.
    steps = pd.read_csv(run_dir / "steps.csv")
    ranks = steps.groupby("case_id")["rank"].nunique()
    assert {s: ranks[cases.loc[s, "case_id"]] for s in ("single", "ddp", "gpipe")} == {
        "single": 1, "ddp": 2, "gpipe": 2}
    timeline = pd.read_csv(run_dir / "timeline.csv")
    assert set(timeline["device"]) == {"n0/cpu:0", "n1/cpu:0"}
    env = json.loads((run_dir / "env.json").read_text())
    assert [n["node_rank"] for n in env["nodes"]] == [0, 1]
    assert len(env["fingerprint"]["nodes"]) == 2
    assert env["launcher"] == {
        "kind": "torchrun", "nnodes": 2, "node_rank": 0,
        "rdzv_endpoint": f"127.0.0.1:{cluster.rdzv}", "coord_port": cluster.coord,
        "source": "flags", "rdzv_timeout_s": 600.0}
    # Node 1 wrote no run folder, and kept nothing of launches that went well.
    assert not list(cluster.out(1).rglob("cases.csv"))
    assert not list(cluster.out(1).rglob("worker.log")), err1
    assert not cluster.wait_gone()


@pytest.mark.timeout(300)
@pytest.mark.integration
def test_a_node_killed_mid_case_is_an_error_row_on_node_0_within_the_timeout(tmp_path):
    timeout_s = 120
    cluster = Cluster(tmp_path)
    args = ("--strategies", "ddp", "--case-timeout-s", str(timeout_s))
    node0 = cluster.start(0, *args, quick_loss=True)
    node1 = cluster.start(1, *args, fault="ddp:*:hang")  # its rank hangs before timing
    _wait_for(lambda: list(cluster.out(1).rglob("rank*.baseline.json")))
    time.sleep(2)  # node 1's rank is in its hang, node 0's waits for it in a collective
    node1.send_signal(signal.SIGKILL)  # the runner: its agent and rank die with it
    killed = time.monotonic()
    code0, _, err0 = finish(node0, timeout=timeout_s + 60)
    finish(node1)
    assert time.monotonic() - killed < timeout_s
    assert code0 == 1, err0
    run_dir = only_run_dir(cluster.out(0))
    assert statuses(run_dir) == {"ddp": "error"}
    reason = pd.read_csv(run_dir / "cases.csv").loc[0, "reason"]
    assert reason.startswith("node 1 (") and "was lost" in reason, reason
    assert not cluster.wait_gone()


@pytest.mark.timeout(300)
@pytest.mark.integration
def test_ctrl_c_on_node_0_stops_every_nodes_ranks(tmp_path):
    cluster = Cluster(tmp_path)
    args = ("--strategies", "ddp", "--case-timeout-s", "200")
    node0 = cluster.start(0, *args)
    node1 = cluster.start(1, *args, fault="ddp:*:hang")
    _wait_for(lambda: list(cluster.out(1).rglob("rank*.baseline.json")))
    node0.send_signal(signal.SIGINT)
    (code0, _, err0), (code1, _, err1) = finish(node0, timeout=60), finish(node1, timeout=60)
    assert code0 == 130, err0
    assert code1 == 130, err1
    assert not cluster.wait_gone()


@pytest.mark.timeout(180)
@pytest.mark.integration
def test_nodes_that_expand_different_sweeps_exit_2_and_write_nothing(tmp_path):
    cluster = Cluster(tmp_path)
    node0 = cluster.start(0, "--strategies", "ddp")
    node1 = cluster.start(1, "--strategies", "ddp,gpipe")
    (code0, _, err0), (code1, _, err1) = finish(node0, timeout=150), finish(node1, timeout=150)
    assert code0 == 2, err0
    assert "node 1 (" in err0 and "expanded another sweep" in err0
    assert code1 == 2, err1
    assert "node 0 refused this node" in err1
    assert not list(tmp_path.rglob("env.json"))


# ---- waiting for the other nodes: said every WAIT_NOTE_S, given up after --rdzv-timeout-s --


def _alone(capsys, monkeypatch, tmp_path, node: int, timeout_s: float):
    """One node of a 2-node run started without the other, in this process, with a waiting
    line every half second; its finished process and how long it took."""
    monkeypatch.setattr(torchrun, "WAIT_NOTE_S", 0.5)
    rdzv, coord = free_ports(2)
    started = time.monotonic()
    proc = in_process(capsys, "run", *NODE, "--strategies", "ddp", "--node-rank", str(node),
                      "--rdzv-endpoint", f"127.0.0.1:{rdzv}", "--coord-port", str(coord),
                      "--rdzv-timeout-s", f"{timeout_s:g}", "--quiet",
                      "--out", str(tmp_path / "out"))
    return proc, time.monotonic() - started


@pytest.mark.timeout(120)
@pytest.mark.integration
def test_a_node_without_node_0_says_it_waits_and_gives_up_with_exit_2(
        tmp_path, capsys, monkeypatch):
    proc, seconds = _alone(capsys, monkeypatch, tmp_path, 1, 3)
    assert proc.returncode == 2, proc.stderr
    assert seconds < 3 + 15  # planning the sweep, then the 3 s, then a connection's second
    waiting = [line for line in proc.stderr.splitlines()
               if line.startswith("node 1: waiting for node 0's coordination store at ")]
    assert len(waiting) >= 3, proc.stderr  # --quiet does not silence them
    assert waiting[0].endswith("of 3 s (--rdzv-timeout-s)"), waiting[0]
    assert "node 1 gave up after 3 s (--rdzv-timeout-s)" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
@pytest.mark.integration
def test_node_0_without_the_others_says_it_waits_and_gives_up_with_exit_2(
        tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(coordination, "BYE_WAIT_S", 0.5)  # no node will read the refusal
    proc, seconds = _alone(capsys, monkeypatch, tmp_path, 0, 3)
    assert proc.returncode == 2, proc.stderr
    # The 3 s, then BYE_WAIT_S for the (absent) nodes to read the refusal.
    assert seconds < 3 + coordination.BYE_WAIT_S + 15
    assert "node 0: waiting for node(s) 1 of 2 to join: " in proc.stderr
    assert "did not join within 3 s (--rdzv-timeout-s" in proc.stderr
    assert not (tmp_path / "out").exists()


def _pair(timeout_s: float) -> tuple[Launcher, Launcher]:
    rdzv, coord = free_ports(2)
    return tuple(Launcher("torchrun", 2, node, f"127.0.0.1:{rdzv}", coord,
                          rdzv_timeout_s=timeout_s) for node in (0, 1))


INFO = {"rig": {"label": "cpu:1x1t"}, "sweep_digest": "d", "hostname": "here"}


@pytest.mark.integration  # starts processes or waits on real time
@pytest.mark.timeout(60)
def test_a_node_that_gave_up_is_not_admitted_after_all(monkeypatch):
    monkeypatch.setattr(coordination, "BYE_WAIT_S", 0.1)
    zero, one = _pair(1)
    coordinator = coordination.Coordinator(zero)  # its store is up, but it gathers late
    follower = coordination.Follower(one, INFO | {"node_rank": 1})
    with pytest.raises(coordination.CoordinationError, match="node 1 gave up after 1 s"):
        follower.wait_welcome()
    follower.close()
    with pytest.raises(coordination.CoordinationError, match="did not join within 1 s"):
        coordinator.gather(INFO | {"node_rank": 0})


@pytest.mark.integration  # starts processes or waits on real time
@pytest.mark.timeout(60)
def test_a_node_admitted_before_its_time_is_up_waits_for_the_welcome():
    zero, one = _pair(0.5)
    coordinator = coordination.Coordinator(zero)
    follower = coordination.Follower(one, INFO | {"node_rank": 1})
    coordinator.gather(INFO | {"node_rank": 0})  # admits node 1 at once
    # Node 0 measures its rig past node 1's 0.5 s; node 1, admitted, keeps waiting.
    later = threading.Timer(1.5, coordinator.welcome, args=("the-run",))
    later.start()
    try:
        assert follower.wait_welcome() == "the-run"
    finally:
        later.join()
        follower.close()


@pytest.mark.parametrize("seconds", [0, -5, float("inf"), float("nan")])
def test_a_rendezvous_timeout_is_a_positive_number_of_seconds(seconds):
    with pytest.raises(UsageError, match="--rdzv-timeout-s must be a number of seconds > 0"):
        torchrun.resolve("torchrun", 2, 1, "127.0.0.1:29500", None, environ={},
                       rdzv_timeout_s=seconds)
    assert torchrun.resolve("torchrun", 2, 1, "127.0.0.1:29500", None, environ={},
                          rdzv_timeout_s=5).rdzv_timeout_s == 5
