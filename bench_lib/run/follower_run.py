"""A non-first node's run of a multi-node sweep: join node 0 (``run_follower``), then start
this node's torchrun agent (``run.agent_launch``) for each launch node 0 announces and report
its part back over node 0's coordination store (``follow_sweep``, ``nodes.coordination``),
until node 0 ends the run.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
from collections.abc import Sequence
from pathlib import Path

from bench_lib.launch.protocol import CaseSpec, RankResult
from bench_lib.launch.ranks import log_tail
from bench_lib.launch.torchrun import Launcher
from bench_lib.nodes.coordination import Follower, LaunchNotice, NodeReport, NodeZeroGone
from bench_lib.nodes.multinode import this_node
from bench_lib.processes.supervision import PEER_GRACE_S
from bench_lib.rig import Rig
from bench_lib.run.agent_launch import run_agent
from bench_lib.sweep.cases import Case


def run_follower(cases: Sequence[Case], rig: Rig, launcher: Launcher, out: Path) -> str:
    """A non-first node's whole run: join node 0 (``CoordinationError`` when it cannot),
    then ``follow_sweep``, with its case folders under ``out/<run id>.node<I>`` (kept only
    for launches that failed here: their worker.log says why)."""
    follower = Follower(launcher, this_node(rig, launcher, cases))
    try:
        run_id = follower.wait_welcome()
    except BaseException:
        follower.close()
        raise
    return follow_sweep(cases, rig, launcher, follower,
                        out / f"{run_id}.node{launcher.node_rank}")


def follow_sweep(cases: Sequence[Case], rig: Rig, launcher: Launcher, follower: Follower,
                 work_root: Path) -> str:
    """A non-first node's run: start this node's agent for each launch node 0 announces,
    and report its part, until node 0 ends the run; returns how it ended (``done``,
    ``interrupted``...). Raises ``coordination.NodeZeroGone`` when node 0 vanishes."""
    by_id = {c.case_id: c for c in cases}
    seq = 0
    try:
        while not (notice := follower.next_notice(seq)).end:
            case = by_id.get(notice.case_id)
            if case is None:  # the digest check makes this a bug, not a user's mistake
                report = NodeReport(launcher.node_rank, socket.gethostname(), stopped=(
                    "error", f"node {launcher.node_rank} has no case {notice.case_id}"))
            else:
                report = _follow_launch(case, rig, launcher, follower, notice, work_root)
            follower.report(seq, report)
            seq += 1
        return notice.end
    except KeyboardInterrupt:
        with contextlib.suppress(NodeZeroGone):  # node 0 may be gone: nobody to tell
            follower.report(seq, NodeReport(launcher.node_rank, socket.gethostname(), stopped=(
                "error", f"node {launcher.node_rank} was interrupted")))
        raise
    finally:
        follower.close()
        if work_root.exists() and not any(work_root.iterdir()):
            work_root.rmdir()


def _follow_launch(case: Case, rig: Rig, launcher: Launcher, follower: Follower,
                   notice: LaunchNotice, work_root: Path) -> NodeReport:
    """This node's part of one announced launch, as a report for node 0."""
    case_dir = work_root / f"{notice.seq}_{case.case_id}"
    shutil.rmtree(case_dir, ignore_errors=True)
    case_dir.mkdir(parents=True)
    spec = CaseSpec(case, rig, notice.trace, notice.cut, notice.warmup_steps,
                    notice.compute_only)  # node 0's ranks are told the same
    spec.write(case_dir / "spec.json")
    log_path = case_dir / "worker.log"
    part = run_agent(spec, case_dir, log_path, launcher, notice.rdzv_id,
                     lambda: follower.should_stop(notice.seq, PEER_GRACE_S))
    files = {int(p.stem.removeprefix("rank")): p for p in case_dir.glob("rank*.json")
             if p.stem.removeprefix("rank").isdigit()}  # not rank<N>.baseline.json
    report = NodeReport(launcher.node_rank, socket.gethostname(),
                        {rank: path.read_text() for rank, path in files.items()},
                        part.exits.exit_codes, part.exits.exited_at, part.stopped,
                        log_tail(log_path))
    results = [RankResult.read(p) for p in files.values()]
    fine = (part.stopped is None and len(files) == case.world_size // launcher.nnodes
            and all(r.status == "ok" and not (r.trace_note or r.diagnostics_note)
                    for r in results))
    if fine:  # else keep worker.log: why (a failure, a missing timeline or diagnostic)
        shutil.rmtree(case_dir, ignore_errors=True)
    return report
