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
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import psutil
import pytest

from tests.conftest import PYTHON, REPO
from tests.test_reliability import TINY, finish, only_run_dir, statuses

NODE = [*TINY, "--devices", "1", "--threads-per-worker", "1", "--launcher", "torchrun",
        "--nnodes", "2"]


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

    def start(self, node: int, *args: str, fault: str = "") -> subprocess.Popen:
        cmd = [PYTHON, "-m", "bench_lib", "run", *NODE, *args, "--node-rank", str(node),
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
            if "bench_lib.run.worker" in cmd and str(self.root) in cmd:
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
        "source": "flags"}
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
    node0 = cluster.start(0, *args)
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
