"""This node's torchrun agent for one launch, started and supervised as the local
launcher's ranks are (the case timeout, the memory cap, the sampler), and what the runner
saw of it (``AgentLaunch``): node 0's side of a torchrun launch (``run.case_launch``) and every
other node's (``run.follower_run``) both run it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

from bench_lib.launch.protocol import CaseSpec, SampleRow
from bench_lib.launch.ranks import rss_over_cap
from bench_lib.launch.sampling import case_sampler
from bench_lib.launch.torchrun import (
    AgentExits,
    AgentRanks,
    Launcher,
    agent_env,
    start_agent,
    torchrun_args,
)
from bench_lib.measure.sampler import Sampler
from bench_lib.nodes.coordination import LaunchWatch
from bench_lib.processes.supervision import supervise


@dataclass
class AgentLaunch:
    """This node's part of one torchrun launch, as its runner saw it."""

    stopped: tuple[str, str] | None
    """Why the runner stopped the agent (``supervise``), if it did."""
    exits: AgentExits
    samples: list[SampleRow]
    sampler_note: str


def run_agent(spec: CaseSpec, case_dir: Path, log_path: Path, launcher: Launcher,
              rdzv_id: str = "", watch: LaunchWatch | None = None) -> AgentLaunch:
    """Start this node's torchrun agent for one launch (``spec``, written in ``case_dir``)
    and supervise it as the local launcher's ranks are: the case timeout, the memory cap,
    the sampler (from when the ranks are found: ``torchrun.AgentRanks``), and ``watch``
    (the other nodes)."""
    case, rig = spec.case, spec.rig
    nproc = case.world_size // launcher.nnodes
    args = torchrun_args(launcher, nproc, rdzv_id, case.measurement.case_timeout_s,
                         case_dir / "torchrun")
    threads = rig.threads_per_worker if rig.kind == "cpu" else None
    agent = start_agent(case_dir / "spec.json", args, log_path, agent_env(threads))
    ranks = AgentRanks(agent, nproc)
    cap = case.measurement.max_memory_per_device_mib if rig.kind == "cpu" else 0.0
    baselines: dict[int, float] = {}
    samplers: list[Sampler] = []
    with contextlib.ExitStack() as stack:

        def tick() -> tuple[str, str] | None:
            ranks.poll()
            if not samplers and ranks.complete:
                order = sorted(ranks.pids)
                pids, slots = [ranks.pids[r] for r in order], {r: ranks.local[r] for r in order}
                samplers.append(stack.enter_context(case_sampler(case, rig, pids, slots)))
            if cap and (why := rss_over_cap(ranks.procs, cap, case_dir, 1, baselines)):
                return "oom", why
            return watch() if watch is not None else None

        stopped = supervise([agent], case.measurement.case_timeout_s, watch=tick,
                             kill=ranks.kill)
    ended = time.time()
    try:
        log_text = log_path.read_text(errors="replace")
    except OSError:
        log_text = ""
    sampler = samplers[0] if samplers else None
    return AgentLaunch(stopped, AgentExits.of(ranks, log_text, ended),
                       sampler.samples if sampler else [],
                       sampler.note if sampler else "no samples: the ranks ended before all "
                                                    "were found")
