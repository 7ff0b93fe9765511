"""How a case's ranks are started: the local launcher, or PyTorch's torchrun.

``local`` (the default): the runner starts each rank itself (``case_launch._run_local``), and the
ranks meet through a ``file://`` rendezvous in the case's folder. ``torchrun``: the runner
starts one torchrun agent per case launch on each node (``python -m torch.distributed.run``,
through ``launch.agent`` so that it dies with the runner), with ``--max-restarts 0`` (a
failed launch is a result, not something to retry) and ``--nproc-per-node G``; the agent
starts the ranks with RANK, LOCAL_RANK, WORLD_SIZE and the store's address in their
environment, and they join through ``env://``.

- One node: ``--standalone``, torchrun's c10d rendezvous on a free port, with a fresh
  rendezvous id per agent (so per case and launch; torchrun ignores an id given with it).
- Several nodes: ``--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID --nnodes N``,
  with an id per case and launch that node 0's runner announces (``nodes.coordination``).
  Node 0's agent hosts the rendezvous store (``is_host``, stated rather than guessed from
  host names, so that two "nodes" on one host work too); the rendezvous, not
  ``--node-rank``, numbers the nodes, so global ranks need not follow node order, and
  nothing here assumes they do.

Single-process cases (single, dp, mp, pipeline, accum) have no ranks to rendezvous: the
runner starts them itself under either launcher.

The runner cannot see the ranks' exit codes under torchrun (they are the agent's children).
It finds the ranks among the agent's children by the RANK in their environment
(``AgentRanks``), watches when each one ends, and reads the exit codes from the failure
summary torchrun prints as it exits (``failure_codes``): the ranks that failed on their own,
as opposed to those the agent stopped after a peer failed (SIGTERM), whom nothing is blamed on.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench_lib.sweep.profile import UsageError

LAUNCHERS = ("local", "torchrun")
ENDPOINT_ENV = "PARABENCH_RDZV_ENDPOINT"
"""Where a multi-node run finds the rendezvous endpoint when ``--rdzv-endpoint`` is not given
(an sbatch script exports it from the head node's name)."""
SLURM_NNODES, SLURM_NODEID = "SLURM_NNODES", "SLURM_NODEID"
TORCHRUN_SUMMARY = "Root Cause (first observed failure)"
"""A line of the failure summary torchrun's agent prints as a launch fails."""
AGENT_STOP_SIGNAL = -signal.SIGTERM
"""The exit code of a rank the agent stopped because a peer had failed: not a failure."""
RDZV_TIMEOUT_S = 600.0
"""How long a node of a multi-node run waits for the others to join (``--rdzv-timeout-s``)."""
WAIT_NOTE_S = 30.0
"""How often a node waiting for the others says so on stderr (even under ``--quiet``: a node
that waits in silence looks hung)."""


@dataclass(frozen=True)
class Launcher:
    """How every multi-process case of a run starts its ranks (the CLI's ``--launcher`` and
    multi-node flags, resolved once by ``resolve``)."""

    kind: str = "local"
    """``local`` (the runner starts each rank) or ``torchrun``."""
    nnodes: int = 1
    """Nodes the run spans; every node runs the same command."""
    node_rank: int = 0
    """This node's index, 0 for the node that writes the run folder (``--node-rank``)."""
    rdzv_endpoint: str = ""
    """``HOST:PORT`` of node 0's rendezvous (multi-node only; empty on one node)."""
    coord_port: int = 0
    """Port of node 0's coordination store (``nodes.coordination``; multi-node only)."""
    source: str = "flags"
    """Where ``nnodes``/``node_rank`` came from: ``flags``, ``SLURM`` or ``default``."""
    rdzv_timeout_s: float = RDZV_TIMEOUT_S
    """How long a node waits for the others to join before it gives up (exit 2): node 0
    for every node's hello, the others for node 0's store and its admission
    (``nodes.coordination``); a waiting node says so on stderr meanwhile."""

    def __post_init__(self) -> None:
        if not (self.rdzv_timeout_s > 0 and math.isfinite(self.rdzv_timeout_s)):
            raise UsageError(f"--rdzv-timeout-s must be a number of seconds > 0, got "
                             f"{self.rdzv_timeout_s:g}")
        if self.kind not in LAUNCHERS:
            raise UsageError(f"unknown launcher {self.kind!r}; valid: {', '.join(LAUNCHERS)}")
        if self.nnodes < 1:
            raise UsageError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank {self.node_rank} is out of range for --nnodes "
                             f"{self.nnodes}: use 0 to {self.nnodes - 1}")
        if self.nnodes > 1 and self.kind != "torchrun":
            raise UsageError("a multi-node run (--nnodes > 1) needs --launcher torchrun")

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def host(self) -> str:
        """The rendezvous endpoint's host: node 0's address."""
        return split_endpoint(self.rdzv_endpoint)[0]

    def as_dict(self) -> dict[str, Any]:
        """env.json ``launcher``."""
        return asdict(self)


LOCAL = Launcher()


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); a bad one is a ``UsageError``."""
    host, sep, port = endpoint.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"rendezvous endpoint {endpoint!r} is not HOST:PORT "
                         "(e.g. node001:29500, a port from 1 to 65535)")
    return host, int(port)


def resolve(kind: str, nnodes: int | None, node_rank: int | None, endpoint: str | None,
            coord_port: int | None, environ: Mapping[str, str] | None = None,
            rdzv_timeout_s: float = RDZV_TIMEOUT_S) -> Launcher:
    """The run's launcher from the CLI's values, with SLURM's environment under torchrun.

    Precedence: flags > SLURM (``SLURM_NNODES``, ``SLURM_NODEID``: torchrun only, so a
    local-launcher run inside an allocation stays one node) > one node. A multi-node run's
    endpoint comes from ``--rdzv-endpoint`` or ``PARABENCH_RDZV_ENDPOINT``, never a guess:
    a node told ``localhost`` would wait for peers that never come. The coordination port
    defaults to the endpoint's port + 1. Bad input is a ``UsageError`` (exit 2).
    """
    env = os.environ if environ is None else environ
    if kind == "local":
        given = [f for f, v in (("--nnodes", nnodes), ("--node-rank", node_rank),
                                ("--rdzv-endpoint", endpoint), ("--coord-port", coord_port))
                 if v is not None]
        if given and not (given == ["--nnodes"] and nnodes == 1):
            raise UsageError(f"{', '.join(given)} need --launcher torchrun")
        return Launcher(rdzv_timeout_s=rdzv_timeout_s)  # LOCAL, its timeout checked
    source = "flags"
    if nnodes is None and SLURM_NNODES in env:
        nnodes, source = _env_int(env, SLURM_NNODES), "SLURM"
    if node_rank is None and SLURM_NODEID in env and (nnodes or 1) > 1:
        node_rank, source = _env_int(env, SLURM_NODEID), "SLURM"
    if nnodes is None and node_rank is None:
        source = "default"
    if node_rank is None and (nnodes or 1) > 1:
        raise UsageError(f"--nnodes {nnodes} needs this node's rank: give --node-rank I (0 on "
                         "the node that writes the run folder, 1 to N-1 on the others), or run "
                         f"under SLURM ({SLURM_NODEID}); every node taking rank 0 would leave "
                         "them all waiting for the others")
    nnodes = 1 if nnodes is None else nnodes
    node_rank = 0 if node_rank is None else node_rank
    Launcher("torchrun", nnodes, node_rank)  # their ranges first: the message names them
    if nnodes == 1:
        if endpoint is not None or coord_port is not None:
            raise UsageError("--rdzv-endpoint and --coord-port are for multi-node runs "
                             "(--nnodes > 1); one node uses torchrun --standalone")
        return Launcher("torchrun", 1, node_rank, source=source, rdzv_timeout_s=rdzv_timeout_s)
    endpoint = endpoint or env.get(ENDPOINT_ENV, "")
    if not endpoint:
        raise UsageError(f"--nnodes {nnodes} needs the rendezvous endpoint of node 0: give "
                         f"--rdzv-endpoint HOST:PORT or set {ENDPOINT_ENV} (the same on every "
                         "node; never localhost unless every node is this host)")
    _, port = split_endpoint(endpoint)
    coord = port + 1 if coord_port is None else coord_port
    if not 0 < coord < 65536 or coord == port:
        raise UsageError(f"coordination port {coord} must be from 1 to 65535 and differ from "
                         f"the rendezvous port {port}; give --coord-port")
    return Launcher("torchrun", nnodes, node_rank, endpoint.strip(), coord, source,
                    rdzv_timeout_s)


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise UsageError(f"{name}={env[name]!r} is not an integer") from None


def torchrun_args(launcher: Launcher, nproc: int, rdzv_id: str,
                  join_timeout_s: float, log_dir: Path) -> list[str]:
    """torchrun's arguments for one launch of a case (before the worker module).

    ``join_timeout_s`` bounds how long an agent waits for the other nodes to join the
    rendezvous (the case's timeout: the runner kills the agent then anyway). ``log_dir``
    takes torchrun's own per-rank folders (and error files): the case's work folder, which
    goes after an ok launch and stays after a failed one; without it torchrun leaves a
    ``torchelastic_*`` folder in the temporary directory at every launch.
    """
    args = ["--nproc-per-node", str(nproc), "--max-restarts", "0", "--log-dir", str(log_dir)]
    if not launcher.multi_node:
        return [*args, "--nnodes", "1", "--standalone"]
    timeout = max(1, round(join_timeout_s))
    is_host = int(launcher.node_rank == 0)
    return [*args, "--nnodes", str(launcher.nnodes), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", launcher.rdzv_endpoint, "--rdzv-id", rdzv_id,
            "--rdzv-conf", f"is_host={is_host},join_timeout={timeout}"]


def start_agent(spec_path: Path, args: list[str], log_path: Path,
                env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a case's torchrun agent, tied to this runner (``launch.agent``), in a process
    group of its own (a terminal's Ctrl-C reaches the runner, which stops it)."""
    cmd = [sys.executable, "-m", "bench_lib.launch.agent", str(os.getpid()), str(spec_path),
           *args]
    with log_path.open("ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(env if env is not None else os.environ,
                                         PYTHONUNBUFFERED="1"),
                                process_group=0)


def agent_env(threads_per_worker: int | None) -> dict[str, str]:
    """The agent's environment: ours, and on a cpu rig OMP_NUM_THREADS = the worker's
    threads where the user set none, so torchrun does not set 1 (its default for several
    ranks); the worker pins its threads either way (``pinning.pin_worker``)."""
    env = dict(os.environ)
    if threads_per_worker is not None:
        env.setdefault("OMP_NUM_THREADS", str(threads_per_worker))
    return env


@dataclass
class AgentRanks:
    """The ranks a torchrun agent started on this node, watched from the runner.

    ``poll`` (each supervision tick) finds them among the agent's children by RANK in their
    environment (until all ``expected`` are found), and notes for each that ended the last
    tick that still saw it running (``exited_at``, wall-clock), as the local launcher does
    for the ranks it started.
    """

    agent: subprocess.Popen[bytes]
    expected: int
    pids: dict[int, int] = field(default_factory=dict)
    """Global rank -> pid."""
    local: dict[int, int] = field(default_factory=dict)
    """Global rank -> LOCAL_RANK (its device slot here)."""
    exited_at: dict[int, float] = field(default_factory=dict)
    _procs: dict[int, psutil.Process] = field(default_factory=dict)
    _seen: float = 0.0

    def poll(self) -> None:
        now = time.time()
        if len(self._procs) < self.expected:
            self._discover()
        for rank, proc in self._procs.items():
            if rank not in self.exited_at and not _running(proc):
                self.exited_at[rank] = self._seen
        self._seen = now

    @property
    def procs(self) -> dict[int, psutil.Process]:
        """Global rank -> its process, for the ranks found."""
        return dict(self._procs)

    @property
    def complete(self) -> bool:
        """Whether every rank of this node has been found."""
        return len(self._procs) >= self.expected

    def _discover(self) -> None:
        try:
            children = psutil.Process(self.agent.pid).children()
        except psutil.Error:  # the agent is gone
            return
        for child in children:
            if child.pid in self.pids.values():
                continue
            try:
                env = child.environ()
                rank, local = int(env["RANK"]), int(env["LOCAL_RANK"])
            except (psutil.Error, KeyError, ValueError):  # not a rank, or not yet exec'd
                continue
            self.pids[rank], self.local[rank], self._procs[rank] = child.pid, local, child

    def kill(self) -> None:
        """SIGKILL the agent's group and every rank found (each in a session of its own,
        with any children of theirs), then reap the agent and wait for the ranks to go."""
        self._discover()  # one last look: a rank started since the last tick
        # A rank that already ended is skipped: its pid (its group's id) may be reused.
        live = [p.pid for p in self._procs.values() if _running(p)]
        for pid in [self.agent.pid, *live]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.agent.wait()
        psutil.wait_procs(list(self._procs.values()), timeout=10)


def _running(proc: psutil.Process) -> bool:
    """Alive and not a zombie (a rank that ended stays one until the agent reaps it)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def failure_codes(log_text: str) -> dict[int, int] | None:
    """The exit code of each rank that torchrun's failure summary names (global rank ->
    code), from the agent's log; None where the log has no summary (the agent ended ok, or
    was killed before it could print one).

    The summary torchrun prints as a launch fails, one entry per failed rank::

        [0]:
          time      : 2026-11-23_05:30:01
          host      : node001
          rank      : 1 (local_rank: 1)
          exitcode  : -9 (pid: 4242) (SIGKILL)
    """
    if TORCHRUN_SUMMARY not in log_text:
        return None
    summary = log_text[log_text.rindex("Failures:"):] if "Failures:" in log_text else log_text
    return {int(rank): int(code) for rank, code in _FAILURE.findall(summary)}


@dataclass(frozen=True)
class AgentExits:
    """What this node's agent and ranks showed as they ended: input to ``ranks.combine``."""

    exit_codes: dict[int, int]
    """Global rank -> exit code, for the ranks torchrun names as failed."""
    exited_at: dict[int, float]
    """Ranks that ended on their own (not stopped by the agent or the runner) -> the last
    wall-clock time they were seen running."""

    @classmethod
    def of(cls, ranks: AgentRanks, log_text: str, agent_ended_s: float) -> AgentExits:
        """From the watched ranks and the agent's log. With torchrun's summary: the ranks it
        names, except those the agent stopped (SIGTERM); a named rank never seen running
        counts from the agent's end. Without one: every rank seen to end before the runner
        stopped anything (the agent ended ok, or was killed before it could say)."""
        codes = failure_codes(log_text)
        if codes is None:
            return cls({}, dict(ranks.exited_at))
        failed = {r: c for r, c in codes.items() if c != AGENT_STOP_SIGNAL}
        return cls(codes, {r: ranks.exited_at.get(r, agent_ended_s) for r in failed})
