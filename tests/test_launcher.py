"""``--launcher torchrun``: the run's launcher resolved from flags and SLURM, torchrun's
arguments, its failure summary read back, bad input refused (exit 2), and real single-node
cases through torchrun on the cpu rig (issue #15).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pandas as pd
import pytest

from bench_lib import commands, exit_codes
from bench_lib.launch import torchrun
from bench_lib.launch.protocol import RankResult
from bench_lib.launch.torchrun import AgentExits, Launcher, failure_codes, resolve, torchrun_args
from bench_lib.nodes import coordination, multinode
from bench_lib.rig import Rig
from bench_lib.run.case_launch import _combine_launch
from bench_lib.sweep.profile import Profile, UsageError
from tests.test_reliability import finish, only_run_dir, start, statuses, workers_of

# ---- the launcher, from flags and SLURM ---------------------------------------------------


def test_torchrun_on_one_node_is_standalone_with_no_restarts():
    launcher = resolve("torchrun", None, None, None, None, environ={})
    assert launcher == Launcher("torchrun", 1, 0, source="default")
    args = torchrun_args(launcher, 2, "ignored", 60, Path("case/torchrun"))
    assert args == ["--nproc-per-node", "2", "--max-restarts", "0",
                    "--log-dir", "case/torchrun", "--nnodes", "1", "--standalone"]


def test_multi_node_takes_slurm_and_the_endpoint_variable_and_hosts_on_node_0():
    env = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", torchrun.ENDPOINT_ENV: "node001:29500"}
    follower = resolve("torchrun", None, None, None, None, environ=env)
    assert (follower.nnodes, follower.node_rank, follower.source) == (2, 1, "SLURM")
    assert (follower.rdzv_endpoint, follower.coord_port) == ("node001:29500", 29501)
    args = torchrun_args(follower, 4, "parabench-3-ddp-l0", 120, Path("case/torchrun"))
    assert args[:4] == ["--nproc-per-node", "4", "--max-restarts", "0"]
    assert args[args.index("--log-dir") + 1] == "case/torchrun"
    assert args[args.index("--rdzv-backend") + 1] == "c10d"
    assert args[args.index("--rdzv-endpoint") + 1] == "node001:29500"
    assert args[args.index("--rdzv-id") + 1] == "parabench-3-ddp-l0"
    assert args[args.index("--rdzv-conf") + 1] == "is_host=0,join_timeout=120"
    assert "--standalone" not in args
    # Flags win over SLURM; node 0 hosts the rendezvous store.
    head = resolve("torchrun", None, 0, "[::1]:2000", 3000, environ=env)
    assert (head.node_rank, head.host, head.coord_port) == (0, "::1", 3000)
    assert "is_host=1" in torchrun_args(head, 1, "x", 5, Path("d"))[-1]


def test_the_local_launcher_ignores_slurm_and_refuses_multi_node_flags():
    assert resolve("local", None, None, None, None, environ={"SLURM_NNODES": "4"}) == \
        torchrun.LOCAL
    with pytest.raises(UsageError, match="need --launcher torchrun"):
        resolve("local", 2, 0, "h:1", None, environ={})


@pytest.mark.parametrize(("nnodes", "rank", "endpoint", "coord", "message"), [
    (2, 0, None, None, "needs the rendezvous endpoint of node 0"),
    (2, None, "h:29500", None, "--nnodes 2 needs this node's rank: give --node-rank I"),
    (2, 2, "h:29500", None, "--node-rank 2 is out of range for --nnodes 2: use 0 to 1"),
    (0, 0, None, None, "--nnodes must be >= 1"),
    (2, 0, "h", None, "is not HOST:PORT"),
    (2, 0, "h:70000", None, "is not HOST:PORT"),
    (2, 0, "h:65535", None, "coordination port 65536"),
    (2, 0, "h:29500", 29500, "differ from the rendezvous port"),
    (1, 0, "h:29500", None, "are for multi-node runs"),
])
def test_bad_launcher_input_says_what_to_give(nnodes, rank, endpoint, coord, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve("torchrun", nnodes, rank, endpoint, coord, environ={})


@pytest.mark.parametrize(("argv", "message"), [
    (["--nnodes", "2"], "needs this node's rank"),
    (["--nnodes", "2", "--node-rank", "0"], "needs the rendezvous endpoint"),
    (["--nnodes", "2", "--node-rank", "5", "--rdzv-endpoint", "127.0.0.1:29500"],
     "--node-rank 5 is out of range"),
    (["--nproc-per-node", "2", "--devices", "1"], "--nproc-per-node 2 and --devices 1 disagree"),
])
def test_the_cli_refuses_bad_launcher_input_with_exit_2_and_writes_nothing(
        argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    code = commands.main(["run", "--rig", "cpu", "--launcher", "torchrun", *argv,
                          "--out", str(out)])
    assert code == exit_codes.EXIT_USAGE
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_run_help_documents_the_launcher_and_the_multi_node_flags(capsys):
    with pytest.raises(SystemExit) as exited:
        commands.main(["run", "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--launcher {local,torchrun}", "--nnodes N", "--node-rank I",
                 "--rdzv-endpoint HOST:PORT", "--coord-port PORT", "--nproc-per-node G",
                 "SLURM_NNODES", "PARABENCH_RDZV_ENDPOINT", "--standalone"):
        assert flag in text, flag


# ---- which cases span nodes ---------------------------------------------------------------


def test_a_multi_node_sweep_spans_process_group_strategies_and_refuses_the_others():
    rig = Rig("cpu", 1, 1, (0,))
    profile = Profile(strategies=("single", "dp", "ddp", "mp", "pipeline", "accum", "gpipe",
                                  "fsdp"),
                      models=("resnet-tiny",), image_sizes=(32,), batch_sizes=(4,),
                      split_sizes=(2,))
    run_rig, cases = multinode.plan_nodes(profile, rig, 2)
    assert run_rig.label == "cpu:1x1t@2nodes" and run_rig.num_devices == 1
    by = {c.strategy: c for c in cases}
    assert {s: (c.status, c.world_size) for s, c in by.items()
            if s in ("ddp", "gpipe", "fsdp", "single")} == {
        "ddp": (None, 2), "gpipe": (None, 2), "fsdp": (None, 2), "single": (None, 1)}
    for name in ("dp", "mp", "pipeline", "accum"):
        assert by[name].status == "unsupported"
        assert "cannot reach another node's" in by[name].reason
        assert "ddp" in by[name].reason and "gpipe" in by[name].reason
    # Planned at the cluster's world size: 2 nodes of 1 device cannot split a batch of 3.
    odd = multinode.plan_nodes(Profile(strategies=("single", "ddp"), models=("resnet-tiny",),
                                 image_sizes=(32,), batch_sizes=(3, 4)), rig, 2)[1]
    assert [(c.batch_size, c.strategy, c.status) for c in odd] == [
        (3, "single", None), (3, "ddp", "skipped"), (4, "single", None), (4, "ddp", None)]


def test_nodes_with_another_sweep_or_rig_are_refused():
    me = {"node_rank": 0, "rig": {"label": "cuda:8@2nodes"}, "sweep_digest": "a"}
    assert coordination._mismatch(me, me | {"node_rank": 1}) == ""
    assert "another sweep" in coordination._mismatch(me, me | {"node_rank": 1,
                                                               "sweep_digest": "b"})
    assert "rig cuda:4@2nodes" in coordination._mismatch(
        me, me | {"node_rank": 1, "rig": {"label": "cuda:4@2nodes"}})


# ---- torchrun's failure summary, and the combined outcome ----------------------------------

SUMMARY = """
Traceback (most recent call last):
  File "torch/distributed/run.py", line 900, in main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
bench_lib.launch.worker FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-23_05:30:02
  host      : node001
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 4241) (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 4241
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_05:30:01
  host      : node001
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4242) (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
============================================================
"""


def test_torchrun_failure_summary_gives_each_failed_ranks_exit_code():
    assert failure_codes("all fine\n") is None
    assert failure_codes(SUMMARY) == {0: -signal.SIGTERM, 1: -signal.SIGKILL}


def test_a_rank_the_agent_stopped_is_not_blamed_for_its_peers_crash(tmp_path):
    # Rank 1 was SIGKILLed; the agent then stopped rank 0 (SIGTERM): both seen gone in the
    # same tick. Only rank 1 ended on its own.
    ranks = type("Ranks", (), {"exited_at": {0: 100.0, 1: 100.0}})()
    exits = AgentExits.of(ranks, SUMMARY, 101.0)
    assert exits.exited_at == {1: 100.0}
    log = tmp_path / "worker.log"
    log.write_text("rank 1 starting\n" + SUMMARY)
    out = _combine_launch(tmp_path, 2, log, None, [exits])
    assert out.status == "error"
    assert out.reason == "rank 1 was killed by SIGKILL without a result: rank 1 starting"


def test_a_lost_node_is_named_first_but_an_oom_is_blamed_before_it(tmp_path):
    lost = {1: "node 1 (b) was lost: its runner stopped answering for 11 s"}
    RankResult(0, "error", "RuntimeError: Connection closed by peer",
               failed_at_unix_s=10.0).write(tmp_path / "rank0.json")
    out = _combine_launch(tmp_path, 2, tmp_path / "worker.log", None,
                          [AgentExits({}, {})], lost)
    assert out.status == "error"
    assert out.reason == (f"{lost[1]}; then rank 0: RuntimeError: Connection closed by peer")
    RankResult(1, "oom", "out of memory: CUDA", failed_at_unix_s=12.0).write(
        tmp_path / "rank1.json")
    oom = _combine_launch(tmp_path, 2, tmp_path / "worker.log", None, [AgentExits({}, {})],
                          lost)
    assert (oom.status, oom.reason) == ("oom", "rank 1: out of memory: CUDA")


# ---- real cases through torchrun, one node --------------------------------------------------


def _agents_under(root: Path) -> set[int]:
    """Live torchrun agents started for cases under ``root`` (their spec paths are there)."""
    import psutil

    found: dict[int, int] = {}
    for p in psutil.process_iter(["cmdline", "ppid"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "torch.distributed.run" in cmd and str(root) in cmd:
            found[p.pid] = p.info["ppid"]
    # A child the agent has forked but not yet exec'd (a rank starting) still shows the
    # agent's command line: it is no agent of its own (seen in CI under load: 3 for 2).
    return {pid for pid, ppid in found.items() if ppid not in found}


def run_seeing_agents(out: Path, *args: str, fault: str = "") -> tuple[int, str, set[int]]:
    """A quiet CLI run; its exit code, stderr, and the torchrun agents seen while it ran."""
    import time

    proc = start(out, "--quiet", *args, fault=fault)
    seen: set[int] = set()
    while proc.poll() is None:
        seen |= _agents_under(out)
        time.sleep(0.2)
    code, _, err = finish(proc)
    return code, err, seen


@pytest.mark.timeout(300)
@pytest.mark.slow  # 45-140 s on 2 cores: started first (conftest), not last
@pytest.mark.integration
def test_torchrun_runs_ddp_and_gpipe_on_one_node_and_blames_a_sigkilled_rank(tmp_path,
                                                                             monkeypatch):
    # One run for both (a runner's start is seconds of CPU): ddp and gpipe go well, and in
    # 1f1b rank 1 is SIGKILLed; the run exits 1 for it (a torchrun run with every case ok
    # exits 0: test_launcher_multinode's two nodes).
    temp = tmp_path / "temp"  # the run's temporary directory, to see what torchrun leaves
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    code, err, agents = run_seeing_agents(tmp_path, "--strategies", "ddp,gpipe,1f1b",
                                          "--devices", "2", "--launcher", "torchrun",
                                          fault="1f1b:1:sigkill")
    assert code == 1, err
    assert len(agents) == 3, "one torchrun agent per case launch"
    run_dir = only_run_dir(tmp_path)
    assert statuses(run_dir) == {"ddp": "ok", "gpipe": "ok", "1f1b": "error"}
    cases = pd.read_csv(run_dir / "cases.csv").set_index("strategy")
    assert (cases["world_size"] == 2).all()
    assert (cases.loc[["ddp", "gpipe"], "timed_steps"] == 2).all()
    # The killed rank is blamed.
    reason = cases.loc["1f1b", "reason"]
    assert reason.startswith("rank 1 was killed by SIGKILL without a result"), reason
    # Every rank's steps came back, and the gpipe timeline has both stages' devices.
    steps = pd.read_csv(run_dir / "steps.csv")
    ranks = steps.groupby("case_id")["rank"].nunique()
    assert {s: ranks[cases.loc[s, "case_id"]] for s in ("ddp", "gpipe")} == {"ddp": 2,
                                                                           "gpipe": 2}
    timeline = pd.read_csv(run_dir / "timeline.csv")
    gpipe = timeline[timeline["case_id"] == cases.loc["gpipe", "case_id"]]
    assert set(gpipe["device"]) == {"cpu:0", "cpu:1"}
    env = json.loads((run_dir / "env.json").read_text())
    assert env["launcher"]["kind"] == "torchrun" and env["launcher"]["nnodes"] == 1
    assert "nodes" not in env
    # Nothing is left: neither the killed case's peers and agent nor the others', nor
    # torchrun's log folders (its --log-dir is the case's work folder).
    assert not workers_of(run_dir) and not _agents_under(tmp_path)
    assert not list(temp.glob("torchelastic_*"))
