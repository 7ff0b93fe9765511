"""The collectives' latency-bandwidth fits and the run's record of them (env.json
``collectives``): arithmetic on the times ``measure.collectives`` measured.

Each collective is fitted as t(n) = alpha + n / beta over the sizes it was timed at (least
squares, ``fit_alpha_beta``): alpha the latency, beta the algorithm bandwidth, n the size as
nccl-tests counts it (its ``size`` column). ``busbw_gb_s`` is nccl-tests' bus bandwidth at
the largest size, algbw times 2(w-1)/w for all_reduce, (w-1)/w for all_gather and
reduce_scatter, 1 for send_recv. ``analysis.bound`` prices a case's gradient and activation
traffic with the fits.

One process's ``.to()`` from one GPU to another (``mp``'s and ``pipeline``'s hand-off
between their stages) is no collective: it is fitted the same way from its own probe
(``measure.device_copy``: both directions, kept as ``Collectives.device_copy``), and where
none was measured (no two GPUs in this process's view: a dry run, a failed probe) priced
with ``ASSUMED_DEVICE_COPY``, which ``device_copy_fit`` names in its note. NCCL's send/recv
fit prices the hand-offs between the processes of torch's pipelining schedules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
"""The collectives measured and fitted, by the names the fits are kept under."""
MIB = 2**20


def bus_factor(op: str, world: int) -> float:
    """nccl-tests' bus bandwidth over algorithm bandwidth for ``op`` on ``world`` ranks."""
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in ("all_gather", "reduce_scatter"):
        return (world - 1) / world
    return 1.0


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """(alpha s, beta bytes/s) of t = alpha + n / beta, least squares; alpha is held at 0
    where the free fit makes it negative (then the fit through the origin)."""
    n = len(sizes)
    if n == 0 or n != len(times):
        raise ValueError(f"need as many times as sizes, got {n} and {len(times)}")
    mx, my = sum(sizes) / n, sum(times) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, times)) / sxx if sxx else 0.0
    alpha = my - slope * mx
    if alpha < 0 or slope <= 0:
        alpha = 0.0
        slope = sum(x * y for x, y in zip(sizes, times)) / sum(x * x for x in sizes)
    return alpha, (1.0 / slope if slope > 0 else float("inf"))


@dataclass(frozen=True)
class CollectiveFit:
    """One collective's measured times and its fit t(n) = alpha + n / beta."""

    sizes_bytes: tuple[int, ...]
    """n per measurement, bytes, as nccl-tests' ``size`` (module docstring)."""
    times_s: tuple[float, ...]
    """Median time at each size (the slowest rank's per repetition), seconds."""
    alpha_s: float
    """Fitted latency per call, seconds."""
    beta_bytes_s: float
    """Fitted algorithm bandwidth, bytes per second."""
    busbw_gb_s: float
    """nccl-tests' bus bandwidth at the largest size, GB/s (1e9 bytes)."""

    def time_s(self, nbytes: float, calls: int = 1) -> float:
        """Predicted time of ``calls`` calls moving ``nbytes`` in all, seconds."""
        return calls * self.alpha_s + nbytes / self.beta_bytes_s

    def as_dict(self) -> dict[str, Any]:
        return {"sizes_bytes": list(self.sizes_bytes), "times_s": list(self.times_s),
                "alpha_s": self.alpha_s, "beta_bytes_s": self.beta_bytes_s,
                "busbw_gb_s": self.busbw_gb_s}

    @classmethod
    def of(cls, op: str, world: int, sizes: Sequence[int], times: Sequence[float]
           ) -> CollectiveFit:
        """Fit ``times`` (seconds) at ``sizes`` (bytes)."""
        alpha, beta = fit_alpha_beta([float(s) for s in sizes], times)
        big = max(range(len(sizes)), key=lambda i: sizes[i])
        busbw = sizes[big] / times[big] * bus_factor(op, world) / 1e9
        return cls(tuple(sizes), tuple(times), alpha, beta, busbw)


ASSUMED_DEVICE_COPY = CollectiveFit((), (), alpha_s=10e-6, beta_bytes_s=25e9,
                                    busbw_gb_s=25.0)
"""The device-to-device copy assumed where none was measured: PCIe 4.0 x16 between two GPUs
without NVLink. 16 GT/s x 16 lanes with 128b/130b coding is 31.5 GB/s each way; NVIDIA's
``p2pBandwidthLatencyTest`` (cuda-samples) reads about 25 GB/s unidirectional
``cudaMemcpyPeer`` there, and about 10 us a copy: the driver's latency and torch's dispatch
of the ``.to()``. An NVLink pair copies 10x faster or more, so on such a box the
assumption overprices mp's transfers; ``device_copy_fit`` names it wherever it is used."""
ASSUMED_COPY_NOTE = ("copy fit assumed: PCIe 4.0 x16, 25 GB/s, 10 us a copy, not measured "
                     "on this rig")
"""What a bound or a prediction priced with ``ASSUMED_DEVICE_COPY`` says of it."""


@dataclass(frozen=True)
class Collectives:
    """The rig's measured collectives (env.json ``collectives``), or why there are none."""

    fits: dict[str, CollectiveFit] = field(default_factory=dict)
    """``OPS`` name -> its fit."""
    backend: str = ""
    world_size: int = 0
    skipped: str = ""
    """Why nothing was measured (then ``fits`` is empty)."""
    wall_s: float = 0.0
    """How long the micro-benchmark took, process start included, seconds."""
    path: str = ""
    """What the times cover: the backend and the memory it was handed (``measure.collectives
    .path_of``; between GPU slots, gloo on host copies of CUDA buffers, the copies timed)."""
    device_copy: CollectiveFit | None = None
    """One process's ``.to()`` between device slots 0 and 1 on two GPUs, timed both ways
    (``measure.device_copy``: each size twice, 0 -> 1 then 1 -> 0); None: not measured."""
    copy_skipped: str = ""
    """Why ``device_copy`` is None, where the run said (``device_copy_fit`` then assumes)."""

    def fit(self, op: str) -> CollectiveFit | None:
        return self.fits.get(op)

    def bandwidth_line(self) -> str:
        """``all_reduce 0.81 GB/s, ... bus bandwidth at 100 MiB (8.6 s)``, or why skipped."""
        if self.skipped:
            return f"skipped: {self.skipped}"
        rates = ", ".join(f"{op} {f.busbw_gb_s:.2f}" for op, f in self.fits.items())
        big = max((max(f.sizes_bytes) for f in self.fits.values()), default=0) / MIB
        return f"{rates} GB/s bus bandwidth at {big:.0f} MiB ({self.wall_s:.1f} s)"

    def copy_line(self) -> str:
        """``device copy 0<->1: 21.3 GB/s, 12 us a copy``, or why it was not measured."""
        f = self.device_copy
        if f is None:
            return f"device copy not measured: {self.copy_skipped or 'no two GPUs'}"
        return (f"device copy 0<->1: {f.beta_bytes_s / 1e9:.1f} GB/s, "
                f"{f.alpha_s * 1e6:.0f} us a copy")

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"skipped": self.skipped} if self.skipped else {
            "backend": self.backend, "world_size": self.world_size,
            "wall_s": round(self.wall_s, 3), "path": self.path,
            "model": "t(n) = alpha_s + n / beta_bytes_s",
            "ops": {op: f.as_dict() for op, f in self.fits.items()}}
        if self.device_copy is not None:
            out["device_copy"] = self.device_copy.as_dict()
        elif self.copy_skipped:
            out["device_copy"] = {"skipped": self.copy_skipped}
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Collectives:
        if not d:
            return cls(skipped="not measured")
        fits = {op: _fit_of(f) for op, f in (d.get("ops") or {}).items()}
        copy = d.get("device_copy") or {}
        return cls(fits, str(d.get("backend") or ""), int(d.get("world_size") or 0),
                   str(d.get("skipped") or ""), float(d.get("wall_s") or 0.0),
                   str(d.get("path") or ""),
                   _fit_of(copy) if "alpha_s" in copy else None,
                   str(copy.get("skipped") or ""))


def _fit_of(f: Mapping[str, Any]) -> CollectiveFit:
    """A fit from its ``as_dict``."""
    return CollectiveFit(tuple(int(s) for s in f["sizes_bytes"]),
                         tuple(float(t) for t in f["times_s"]), float(f["alpha_s"]),
                         float(f["beta_bytes_s"]), float(f["busbw_gb_s"]))


def device_copy_fit(collectives: Collectives | None) -> tuple[CollectiveFit, str]:
    """The fit one process's ``.to()`` between two GPUs is priced with, and what to say of
    it: the rig's measured copy and "", or ``ASSUMED_DEVICE_COPY`` and ``ASSUMED_COPY_NOTE``."""
    found = collectives.device_copy if collectives is not None else None
    return (found, "") if found is not None else (ASSUMED_DEVICE_COPY, ASSUMED_COPY_NOTE)
