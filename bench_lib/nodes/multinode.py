"""A multi-node run planned: the same sweep over N nodes, every node running the same command.

    python -m bench_lib run ... --launcher torchrun --nnodes N --node-rank I \\
        --rdzv-endpoint HOST:PORT

**Which cases.** Every node expands the same sweep on the cluster's devices (N x G:
``plan``), so batch divisibility and the pipelining schedules' limits are judged at the
world size the cases will have. Only the strategies of one process per device (ddp, fsdp,
the torch.distributed.pipelining schedules) span nodes; single, dp, mp, pipeline and accum
drive their devices from one process, which cannot reach another node's, so they are
``unsupported`` with that reason, except ``single``, measured on node 0's first device as
the baseline of the speedups (the other nodes sit it out).

**What a node says about itself.** Each node tells node 0 its ``node_info`` (``NODE_KEYS``
of its environment and its sweep's digest), and env.json lists every node's
(``cluster_env``). How the nodes then run together, over node 0's store, is
``nodes.coordination``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from collections.abc import Sequence
from typing import Any

from bench_lib import strategies
from bench_lib.launch.torchrun import Launcher
from bench_lib.rig import Rig
from bench_lib.sweep.cases import Case
from bench_lib.sweep.expansion import expand
from bench_lib.sweep.profile import Profile

NODE_KEYS = ("hostname", "platform", "versions", "rig", "device_names", "cpu_model",
             "cpu_cores", "git", "fingerprint")
"""The env.json keys each node reports about itself (env.json ``nodes``)."""


# ---- which cases: planned on the cluster's devices ------------------------------------------


def cluster_rig(rig: Rig, nnodes: int) -> Rig:
    """The rig the sweep is planned on: N x this node's devices (and, on a cpu rig, N x its
    cores), so that strategies of one process per device get world size N x G."""
    return dataclasses.replace(rig, num_devices=rig.num_devices * nnodes,
                               cores=rig.cores * nnodes,
                               physical_cores=rig.physical_cores * nnodes, nodes=1)


def plan_nodes(profile: Profile, rig: Rig, nnodes: int) -> tuple[Rig, list[Case]]:
    """The run's rig (this node's devices, ``nodes`` = N) and the sweep's cases across N
    nodes (module docstring)."""
    cases = expand(profile, cluster_rig(rig, nnodes))
    spanning = ", ".join(sorted(n for n, s in strategies.REGISTRY.items()
                                if s.per_device_processes))
    out = []
    for case in cases:
        if case.process_group and case.world_size == 1:  # ddp-1: a group of one
            case = dataclasses.replace(case, status="unsupported", reason=(
                f"{case.strategy} is a process group of one device (a wrapper's own cost); "
                "it spans no nodes: measure it in a one-node run"))
        elif case.process_group:  # the rig's note (e.g. "over loopback") no longer holds
            case = dataclasses.replace(case, note="; ".join(filter(None, [
                f"spans {nnodes} nodes of {rig.num_devices} device(s) each; ranks on "
                "different nodes talk over the network",
                case.ddp.arithmetic_note if case.ddp else ""])))
        elif case.strategy == "single":
            case = dataclasses.replace(case, note="; ".join(filter(None, [
                case.note, "on node 0's first device: the baseline of the speedups"])))
        else:
            case = dataclasses.replace(case, status="unsupported", reason=(
                f"{case.strategy} drives its devices from one process, which cannot reach "
                f"another node's: in a multi-node run only {spanning} span nodes"))
        out.append(case)
    return dataclasses.replace(rig, nodes=nnodes), out


# ---- what a node says about itself ----------------------------------------------------------


def sweep_digest(cases: Sequence[Case]) -> str:
    """A hash of the cases to run, with their settings: every node must walk the same."""
    text = json.dumps([c.as_dict() for c in cases], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def node_info(env: dict[str, Any], node_rank: int, digest: str) -> dict[str, Any]:
    """What a node tells node 0 about itself: ``NODE_KEYS`` of its environment."""
    return {"node_rank": node_rank, **{k: env.get(k) for k in NODE_KEYS},
            "sweep_digest": digest}


def this_node(rig: Rig, launcher: Launcher, cases: Sequence[Case]) -> dict[str, Any]:
    """This node's ``node_info``, from what env.json would record here."""
    from bench_lib.measure import environment

    return node_info(environment.collect(rig, {}, sys.argv), launcher.node_rank,
                     sweep_digest(cases))


def cluster_env(env: dict[str, Any], infos: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """env.json of a multi-node run: every node listed (``nodes``), and the hardware
    fingerprint covering all of them (``fingerprint.nodes``: each node's own)."""
    nodes = [{k: v for k, v in info.items() if k != "sweep_digest"} for info in infos]
    return env | {"nodes": nodes,
                  "fingerprint": env["fingerprint"] | {
                      "nodes": [info["fingerprint"] for info in infos]}}

