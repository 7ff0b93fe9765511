"""The nodes of a multi-node run working together over node 0's c10d ``TCPStore``: who
takes part, which launch comes next, each node's part of it, and who is gone.

**Coordination.** Node 0's runner walks the sweep (``runner.run_sweep``) and hosts a c10d
``TCPStore`` on the coordination port (the rendezvous port + 1 unless ``--coord-port``); the
other nodes' runners follow it (``follower_run.follow_sweep``). Keys, under ``parabench/``::

    hello/<i>       node i's NodeInfo: host, devices, versions, fingerprint, sweep digest;
                    then ADMITTED (node 0 took it) or WITHDRAWN (node i gave up first)
    welcome/<i>     node 0's answer: the run id, or why node i cannot take part
    launch/<n>      the n-th multi-node launch: case id, launch, rendezvous id, cut, trace;
                    or the end of the run (done, interrupted)
    report/<n>/<i>  node i's part of launch n: its ranks' result files, how they ended
    over/<n>        node 0's ranks of launch n are done: the others stop theirs after a grace
    beat/<i>        a counter node i adds to every HEARTBEAT_S

A node whose sweep or rig differs from node 0's is refused before anything is written
(exit 2 on both sides). Nothing waits forever: node 0 waits ``--rdzv-timeout-s``
(``Launcher.rdzv_timeout_s``) for the nodes to come, and each other node as long for node 0's
store and its admission, each saying on stderr every ``torchrun.WAIT_NOTE_S`` that it waits,
then giving up with exit 2 (a node gives up only by swapping its hello for WITHDRAWN, node 0
admits it only by swapping it for ADMITTED: one of the two wins, so node 0 never starts a run
with a node that left, nor a node leaves one that counts on it). A node whose heartbeat
stops for ``LOST_AFTER_S`` is lost (its case is an ``error`` row naming it, well within the
case timeout); the other nodes find node 0 gone when its store stops answering, stop their
ranks and exit. Ctrl-C on node 0 sets the end of the run, and every node stops its ranks.

**Gathering: over this store, not the process group, nor a shared folder.** Each node's
ranks write their result files into that node's case folder, as on one node; each runner
sends its files to node 0 in its report, and node 0 combines them as the local launcher's
(``launch.ranks.combine``). Not over the case's process group: a gather there needs the group
to work, and the results that matter most, an out-of-memory or a crash on one rank, are
exactly those that break it; it would also add a collective to the measured process after
its timed steps. Not through a shared file system: clusters do not all have one, and a
node's rank files would still need a runner on that node to say how its ranks ended. Only
node 0 samples utilisation and power (its own devices).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench_lib.launch import torchrun
from bench_lib.launch.protocol import CaseSpec
from bench_lib.launch.torchrun import Launcher
from bench_lib.nodes.multinode import this_node
from bench_lib.rig import Rig
from bench_lib.sweep.cases import Case
from bench_lib.sweep.profile import UsageError

HEARTBEAT_S = 1.0
LOST_AFTER_S = 10.0
"""A node whose heartbeat has not moved for this long is lost."""
POLL_S = 0.2
STORE_TIMEOUT_S = 30.0
"""Each store operation's limit: a node 0 that stops answering is gone."""
BYE_WAIT_S = 5.0
"""How long node 0 keeps its store open at the end for the others to read that it ended."""
PREFIX = "parabench"
ADMITTED, WITHDRAWN = "admitted", "withdrawn"
"""What a node's hello is swapped for: node 0 took it, or the node gave up first."""


LaunchWatch = Callable[[], tuple[str, str] | None]
"""Checked at each supervision tick of a node's agent: why to stop it now, or None."""


class CoordinationError(UsageError):
    """The nodes could not start a run together (exit 2, nothing written)."""


class NodeZeroGone(RuntimeError):
    """Node 0's coordination store stopped answering."""



# ---- messages --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchNotice:
    """Node 0's word on the n-th multi-node launch of the run (or on its end)."""

    seq: int
    case_id: str = ""
    launch: int = 0
    """The launch's round (0-based)."""
    rdzv_id: str = ""
    trace: bool = False
    cut: str = ""
    warmup_steps: int | None = None
    """The warm-up as a fixed count (``protocol.CaseSpec.warmup_steps``)."""
    compute_only: bool = True
    """Time the compute-only steps (``protocol.CaseSpec.compute_only``): every node's ranks
    alike, since they start them behind one barrier."""
    end: str = ""
    """Non-empty: no launch, the run ended (``done``, ``interrupted``, or why it stopped)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LaunchNotice:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class NodeReport:
    """One node's part of one launch: its ranks' result files and how they ended."""

    node: int
    hostname: str
    results: dict[int, str] = field(default_factory=dict)
    """Global rank -> its result file's text (``protocol.RankResult``)."""
    exit_codes: dict[int, int] = field(default_factory=dict)
    """Ranks torchrun named as failed -> exit code (``torchrun.AgentExits``)."""
    exited_at: dict[int, float] = field(default_factory=dict)
    """Ranks that ended on their own -> last wall-clock time seen running."""
    stopped: tuple[str, str] | None = None
    """Why the node's runner stopped its agent (status, reason), if it did."""
    log_tail: str = ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> NodeReport:
        d = json.loads(text)

        def ints(m: dict[str, Any]) -> dict[int, Any]:
            return {int(k): v for k, v in m.items()}

        return cls(d["node"], d["hostname"], ints(d["results"]), ints(d["exit_codes"]),
                   ints(d["exited_at"]), tuple(d["stopped"]) if d["stopped"] else None,
                   d["log_tail"])


def _store(host: str, port: int, master: bool, timeout_s: float) -> Any:
    """A c10d TCPStore under ``parabench/`` (node 0 hosts it; the others connect, retrying
    until ``timeout_s``)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import PrefixStore

    # torch.distributed imports TCPStore from its C++ module without listing it in
    # __all__, so mypy --strict does not see it exported; it is the public name.
    store = dist.TCPStore(  # type: ignore[attr-defined]
        host, port, is_master=master, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s))
    # Connected: from now on a store that stops answering is gone within STORE_TIMEOUT_S.
    store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
    return PrefixStore(PREFIX, store), store


def _get(store: Any, key: str) -> str:
    return bytes(store.get(key)).decode()


def _swap(store: Any, key: str, expected: str, desired: str) -> str:
    """Set ``key`` to ``desired`` where it holds ``expected`` (absent: ""); what it holds
    after (``desired`` where the swap happened)."""
    return bytes(store.compare_set(key, expected, desired)).decode()


class Waiting:
    """Says on stderr, every ``torchrun.WAIT_NOTE_S``, what a node has been waiting for, and
    for how long out of its ``--rdzv-timeout-s`` (``None``: no limit of its own)."""

    def __init__(self, who: str, limit_s: float | None) -> None:
        self.who, self.limit_s = who, limit_s
        self.started = time.monotonic()
        self._next = self.started + torchrun.WAIT_NOTE_S

    @property
    def waited_s(self) -> float:
        return time.monotonic() - self.started

    def over(self) -> bool:
        """Whether the limit has passed."""
        return self.limit_s is not None and self.waited_s >= self.limit_s

    def tick(self, what: str) -> None:
        """Say what this node waits for, where ``WAIT_NOTE_S`` has passed since it last did."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + torchrun.WAIT_NOTE_S
        limit = f" of {self.limit_s:g} s (--rdzv-timeout-s)" if self.limit_s is not None else " s"
        print(f"{self.who}: waiting for {what}: {self.waited_s:.0f}{limit}", file=sys.stderr,
              flush=True)


# ---- node 0 -------------------------------------------------------------------------------


class Coordinator:
    """Node 0's side: hosts the store, admits the nodes, announces launches, collects."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        try:
            self._store, self._server = _store(launcher.host, launcher.coord_port, True,
                                               STORE_TIMEOUT_S)
        except Exception as e:  # a port in use, a host name that is not this node
            raise CoordinationError(
                f"cannot host the coordination store on port {launcher.coord_port} of "
                f"{launcher.host} ({type(e).__name__}: {e}); is --rdzv-endpoint this node, "
                "and the port free? (--coord-port chooses another)") from None
        self._seq = 0
        self._beats: dict[int, tuple[int, float]] = {}
        self.infos: list[dict[str, Any]] = []

    @property
    def others(self) -> range:
        return range(1, self.launcher.nnodes)

    def gather(self, me: dict[str, Any]) -> None:
        """Wait for every node's hello, admitting each (``ADMITTED``); refuse (exit 2
        everywhere) a node whose sweep or rig differs from ours, or all of them when one does
        not come within ``--rdzv-timeout-s``, saying meanwhile whom it waits for."""
        timeout_s = self.launcher.rdzv_timeout_s
        waiting = Waiting("node 0", timeout_s)
        came: dict[int, dict[str, Any]] = {}
        while True:
            for i in self.others:
                if i not in came and self._store.check([f"hello/{i}"]):
                    text = _get(self._store, f"hello/{i}")
                    if text not in (ADMITTED, WITHDRAWN) and _swap(
                            self._store, f"hello/{i}", text, ADMITTED) == ADMITTED:
                        came[i] = json.loads(text)
            missing = [i for i in self.others if i not in came]
            if not missing or waiting.over():
                break
            waiting.tick(f"node(s) {', '.join(map(str, missing))} of {self.launcher.nnodes} "
                         "to join")
            time.sleep(POLL_S)
        if missing:
            why = (f"node(s) {', '.join(map(str, missing))} of {self.launcher.nnodes} did "
                   f"not join within {timeout_s:g} s (--rdzv-timeout-s; each runs the same "
                   f"command with its --node-rank, reaching "
                   f"{self.launcher.host}:{self.launcher.coord_port})")
            self._refuse(why)
            raise CoordinationError(why)
        infos = [me] + [came[i] for i in self.others]
        problems = [_mismatch(me, info) for info in infos[1:]]
        if any(problems):
            why = "the nodes cannot run together: " + "; ".join(p for p in problems if p)
            self._refuse(why)
            raise CoordinationError(why)
        self.infos = infos
        for i in self.others:
            self._beats[i] = (-1, time.monotonic())

    def _refuse(self, why: str) -> None:
        """Tell every node (those that came read it) that the run will not start."""
        for i in self.others:
            self._store.set(f"welcome/{i}", json.dumps({"refused": why}))
        self.finish("refused")

    def welcome(self, run_id: str) -> None:
        """Tell the nodes the run has started (its folder is written on this node)."""
        for i in self.others:
            self._store.set(f"welcome/{i}", json.dumps({"run_id": run_id}))

    def announce(self, spec: CaseSpec, launch: int) -> LaunchNotice:
        """Publish the next launch (``spec``, in round ``launch``); the other nodes start
        their agents on it, their ranks told what node 0's are."""
        case_id = spec.case.case_id
        notice = LaunchNotice(self._seq, case_id, launch,
                              f"parabench-{self._seq}-{case_id}-l{launch}", spec.trace,
                              spec.cut, spec.warmup_steps, spec.compute_only)
        self._seq += 1
        self._store.set(f"launch/{notice.seq}", notice.to_json())
        return notice

    def lost(self) -> dict[int, str]:
        """Nodes whose heartbeat has not moved for ``LOST_AFTER_S`` -> why they are lost."""
        out, now = {}, time.monotonic()
        for i in self.others:
            beat = int(self._store.add(f"beat/{i}", 0))
            last, since = self._beats.get(i, (-1, now))
            if beat != last:
                self._beats[i] = (beat, now)
            elif now - since > LOST_AFTER_S:
                out[i] = (f"node {i} ({self._host(i)}) was lost: its runner stopped answering "
                          f"for {now - since:.0f} s")
        return out

    def reported(self, seq: int) -> list[int]:
        """The nodes whose report of launch ``seq`` is in."""
        return [i for i in self.others if self._store.check([f"report/{seq}/{i}"])]

    def watch(self, seq: int, grace_s: float) -> LaunchWatch:
        """When to stop node 0's own agent of launch ``seq``: at once when a node is lost
        (its ranks are gone: ours wait in vain), or ``grace_s`` after a node reported (its
        ranks ended; ours had as long to end too)."""
        first: list[float] = []

        def check() -> tuple[str, str] | None:
            lost = self.lost()
            if lost:
                return "error", "; ".join(lost.values())
            done = self.reported(seq)
            if done and not first:
                first.append(time.monotonic())
            if first and time.monotonic() - first[0] > grace_s:
                return "error", (f"stopped {grace_s:g} s after node(s) "
                                 f"{', '.join(map(str, done))} ended their ranks")
            return None

        return check

    def over(self, seq: int) -> None:
        """Node 0's ranks of launch ``seq`` have ended: the others may stop theirs."""
        self._store.set(f"over/{seq}", "1")

    def collect(self, seq: int, timeout_s: float) -> tuple[dict[int, NodeReport],
                                                          dict[int, str]]:
        """Every node's report of launch ``seq``, waiting up to ``timeout_s``; a node lost
        meanwhile, or silent past it, is returned with why instead."""
        reports: dict[int, NodeReport] = {}
        lost: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while True:
            for i in self.reported(seq):
                if i not in reports:
                    reports[i] = NodeReport.from_json(_get(self._store, f"report/{seq}/{i}"))
            waiting = [i for i in self.others if i not in reports]
            lost = {i: why for i, why in self.lost().items() if i in waiting}
            if not waiting or set(waiting) <= set(lost):
                return reports, lost
            if time.monotonic() > deadline:
                return reports, lost | {i: f"node {i} ({self._host(i)}) sent no result "
                                           f"within {timeout_s:.0f} s of node 0's end"
                                        for i in waiting if i not in lost}
            time.sleep(POLL_S)

    def finish(self, why: str) -> None:
        """Announce the end of the run (``done``, ``interrupted``...) and give the nodes a
        moment to read it before this store closes with the runner."""
        try:
            self._store.set(f"launch/{self._seq}", LaunchNotice(self._seq, end=why).to_json())
            deadline = time.monotonic() + BYE_WAIT_S
            while (time.monotonic() < deadline
                   and not all(self._store.check([f"bye/{i}"]) for i in self.others)):
                time.sleep(POLL_S)
        except Exception:  # the store is ours: nothing left to tell if it is broken
            pass

    def _host(self, i: int) -> str:
        return str(self.infos[i].get("hostname")) if i < len(self.infos) else "?"


def open_coordinator(launcher: Launcher, rig: Rig, cases: Sequence[Case]) -> Coordinator:
    """Node 0: host the store and admit every node (``CoordinationError``: exit 2)."""
    coordinator = Coordinator(launcher)
    coordinator.gather(this_node(rig, launcher, cases))
    return coordinator


def _mismatch(me: dict[str, Any], other: dict[str, Any]) -> str:
    """Why a node cannot join node 0's run ('' when it can)."""
    who = f"node {other['node_rank']} ({other.get('hostname')})"
    if other["rig"]["label"] != me["rig"]["label"]:
        return (f"{who} has rig {other['rig']['label']}, node 0 {me['rig']['label']}: "
                "give every node the same --rig/--devices/--threads-per-worker")
    if other["sweep_digest"] != me["sweep_digest"]:
        return f"{who} expanded another sweep: run the same command (flags, profile) everywhere"
    return ""


# ---- the other nodes -------------------------------------------------------------------------


class Follower:
    """Node i's side (i > 0): says hello, beats, reads launches, reports its part."""

    def __init__(self, launcher: Launcher, info: dict[str, Any]) -> None:
        self.node = launcher.node_rank
        self._launcher = launcher
        self._where = f"{launcher.host}:{launcher.coord_port}"
        self._waiting = Waiting(f"node {self.node}", launcher.rdzv_timeout_s)
        self._reach()
        try:
            self._store, _ = _store(launcher.host, launcher.coord_port, False, STORE_TIMEOUT_S)
        except Exception as e:
            raise CoordinationError(f"node 0's coordination store at {self._where} did not "
                                    f"answer ({type(e).__name__}: {e})") from None
        self._mine = json.dumps(info)
        held = _swap(self._store, f"hello/{self.node}", "", self._mine)
        if held == WITHDRAWN:  # an earlier runner of this rank gave up: take its place
            held = _swap(self._store, f"hello/{self.node}", WITHDRAWN, self._mine)
        if held != self._mine:
            who = json.loads(held).get("hostname") if held.startswith("{") else "another node"
            raise CoordinationError(f"node rank {self.node} is taken by {who}: give each node "
                                    "its own")
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True)
        self._beat.start()
        self._over: dict[int, float] = {}

    def _heartbeat(self) -> None:
        """Add to ``beat/<i>`` every HEARTBEAT_S through a connection of its own, until
        closed or node 0 is gone."""
        try:
            store, _ = _store(self._launcher.host, self._launcher.coord_port, False,
                              STORE_TIMEOUT_S)
            while not self._stop.wait(HEARTBEAT_S):
                store.add(f"beat/{self.node}", 1)
        except Exception:  # node 0 gone: the main thread finds out on its next look
            pass

    def _reach(self) -> None:
        """Wait until node 0's store listens, saying so (``Waiting``); a
        ``CoordinationError`` past ``--rdzv-timeout-s``. Probed with a bare connection:
        the store's client would log a stack trace at each of its own retries."""
        host, port = self._launcher.host, self._launcher.coord_port
        while True:
            try:
                with socket.create_connection((host, port), timeout=1.0):
                    return
            except OSError as e:
                last = e
            if self._waiting.over():
                raise CoordinationError(
                    f"node {self.node} gave up after {self._waiting.limit_s:g} s "
                    f"(--rdzv-timeout-s): node 0's coordination store at {self._where} never "
                    f"answered ({last.strerror or last}); is node 0 running the same "
                    "command, and --rdzv-endpoint its address?")
            self._waiting.tick(f"node 0's coordination store at {self._where}")
            time.sleep(POLL_S)

    def _wait_for(self, key: str, on_wait: Callable[[], None] | None = None) -> str:
        """The value of ``key`` once node 0 sets it, calling ``on_wait`` meanwhile;
        ``NodeZeroGone`` when the store cannot answer."""
        while True:
            try:
                if self._store.check([key]):
                    return _get(self._store, key)
                if on_wait is not None:
                    on_wait()
            except CoordinationError:
                raise
            except Exception as e:
                raise NodeZeroGone(f"node 0's store stopped answering ({type(e).__name__}: "
                                   f"{e})") from None
            time.sleep(POLL_S)

    def _admission(self) -> None:
        """While waiting for the welcome: say so; past ``--rdzv-timeout-s``, withdraw this
        node's hello (``CoordinationError``), unless node 0 has admitted it already: then
        node 0 answers, whatever comes (it measures its rig before it does)."""
        if self._waiting.over():
            hello = f"hello/{self.node}"
            if _swap(self._store, hello, self._mine, WITHDRAWN) == WITHDRAWN:
                raise CoordinationError(
                    f"node {self.node} gave up after {self._waiting.limit_s:g} s "
                    f"(--rdzv-timeout-s): node 0 at {self._where} did not admit every node "
                    "in time")
            self._waiting.limit_s = None
        admitted = self._waiting.limit_s is None
        self._waiting.tick("node 0 to start the run (it admitted this node)" if admitted
                           else "node 0 to admit every node")

    def wait_welcome(self) -> str:
        """The run id node 0 gives; a refusal, or no admission within ``--rdzv-timeout-s``,
        is a ``CoordinationError``."""
        answer = json.loads(self._wait_for(f"welcome/{self.node}", self._admission))
        if "refused" in answer:
            raise CoordinationError(f"node 0 refused this node: {answer['refused']}")
        return str(answer["run_id"])

    def next_notice(self, seq: int) -> LaunchNotice:
        return LaunchNotice.from_json(self._wait_for(f"launch/{seq}"))

    def should_stop(self, seq: int, grace_s: float) -> tuple[str, str] | None:
        """Why to stop this node's ranks of launch ``seq`` now, or None: node 0 is gone or
        ended the run, or its ranks ended ``grace_s`` ago (ours had as long to finish)."""
        try:
            if self._store.check([f"launch/{seq + 1}"]):
                return "error", "node 0 ended the run"
            if self._store.check([f"over/{seq}"]):
                first = self._over.setdefault(seq, time.monotonic())
                if time.monotonic() - first > grace_s:
                    return "error", f"node 0's ranks ended {grace_s:g} s earlier"
        except Exception as e:
            return "error", f"node 0's store stopped answering ({type(e).__name__})"
        return None

    def report(self, seq: int, report: NodeReport) -> None:
        try:
            self._store.set(f"report/{seq}/{self.node}", report.to_json())
        except Exception as e:
            raise NodeZeroGone(f"node 0's store stopped answering ({type(e).__name__}: "
                               f"{e})") from None

    def close(self) -> None:
        """Stop beating, and tell node 0 (if it still listens) that this node has seen the
        end."""
        self._stop.set()
        try:
            self._store.set(f"bye/{self.node}", "1")
        except Exception:
            pass

