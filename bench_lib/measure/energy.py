"""Power with nothing of ours running, and the rules for a timed window's sampler figures.

Energy counters see more than a case: RAPL a whole CPU package (every core on it, the runner,
other tenants), NVML a whole GPU (its idle draw included). So the rig's idle power is measured
once per run, before anything of ours runs, over the same counters the cases are read through
(RAPL: the packages holding the rig's cores; NVML: every GPU of the rig), and each case's
energy is given both gross and net of it. Net energy per image is what the case added, and it
compares across strategies: gross does not (RAPL counts the whole package whichever workers
are busy, NVML only the GPUs a case uses).

    idle = idle_power([RaplSource(packages={0})], seconds=2.0)
    idle.watts        # {"host": 11.8}: keyed like the samples' device labels
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench_lib.measure.sampler import Reading, Sampler, Source
from bench_lib.rig import Rig
from bench_lib.topology import CpuTopology, read_cpu_topology

IDLE_SECONDS = 2.0
"""How long idle power is sampled, once per run."""
MIN_WINDOW_S = 1.0
"""A timed window shorter than this gets no utilisation, power or energy: NVML's own
utilisation and power readings average over 1/6 s to 1 s depending on the GPU."""
MIN_SAMPLES = 3
"""Fewest samples per device (or counter) inside the timed window for its utilisation
(or energy) to be reported: two readings are one interval, which a single tick can skew."""


@dataclass(frozen=True)
class IdlePower:
    """The rig's power with nothing of ours running (env.json ``idle_power``)."""

    watts: dict[str, float] = field(default_factory=dict)
    """Samples' device label -> idle watts: ``host`` (RAPL, the rig's packages), ``0``.. (GPUs)."""
    seconds: float = 0.0
    """How long it was sampled."""
    sources: list[str] = field(default_factory=list)
    """What was read, e.g. ``rapl intel-rapl:0 (package 0)`` or ``nvml gpu 0``."""
    unsupported: str = ""
    """Why there is no idle figure (no readable counter)."""

    def as_dict(self) -> dict[str, Any]:
        if self.unsupported:
            return {"unsupported": self.unsupported}
        return {"watts": self.watts, "seconds": self.seconds, "sources": self.sources}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> IdlePower:
        if not d:
            return cls(unsupported="not measured")
        return cls({k: float(v) for k, v in (d.get("watts") or {}).items()},
                   float(d.get("seconds") or 0.0), list(d.get("sources") or []),
                   str(d.get("unsupported") or ""))


def counter_rates(samples: Sequence[Reading], min_samples: int = 2) -> dict[str, float]:
    """Mean power (W) per device label from its energy counter's first and last reading."""
    points: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        if s.get("energy_j") is not None:
            points.setdefault(s["device"], []).append((s["time_unix_s"], s["energy_j"]))
    return {d: (p[-1][1] - p[0][1]) / (p[-1][0] - p[0][0]) for d, p in points.items()
            if len(p) >= min_samples and p[-1][0] > p[0][0]}


def idle_power(sources: Sequence[Source], described: Sequence[str],
               seconds: float = IDLE_SECONDS, interval_s: float = 0.1) -> IdlePower:
    """Sample ``sources`` for ``seconds`` and return their mean power per device label.

    ``described`` says what the sources read (env.json). No source, or no counter read:
    ``unsupported`` with the reason.
    """
    if not sources:
        return IdlePower(unsupported="no readable energy counter (RAPL: /sys/class/powercap "
                                     "is root-only on most kernels; NVML: no GPU)")
    with Sampler(sources, interval_s) as sampler:
        time.sleep(seconds)
    watts = counter_rates(sampler.samples, MIN_SAMPLES)
    if not watts:
        return IdlePower(unsupported=f"no energy counter advanced over {seconds:g} s")
    return IdlePower(watts, seconds, list(described))


def rig_packages(rig: Rig, topology: CpuTopology | None = None) -> set[int] | None:
    """The CPU packages holding a cpu rig's cores (None where the topology is unknown);
    ``topology`` defaults to sysfs's for the rig's cores."""
    topology = topology or read_cpu_topology(rig.cores)
    if topology.source != "sysfs":
        return None
    held = set(rig.cores)
    return {c.package for c in topology.cores if held & set(c.cpus)}
