"""A workload's calibration as data: what it measured and what it covers.

The calibration (``prediction.calibration`` launches it) is measured once per workload (model,
image size, precision, loss, memory format) before its cases launch, in a few seconds: on
one device alone, and on every device at once with no communication ("together": what
data-parallel ranks and pipeline stages do side by side), at each batch size the sweep's
cases compute on a device (``prediction.step_time.calibration_sizes``), the whole training
step (forward, loss, backward, optimizer step) and, where a pipelining schedule cuts the
model, each block's forward and backward; and the optimizer step alone. ``Calibration``
holds those costs (and calibration.json's form of them), ``Sizes`` the batch sizes one
measures; the step-time prediction (``prediction.step_time``) reads them. No torch, no
other module of ours.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class BatchCosts:
    """One batch size's calibrated costs, seconds (medians over repeats)."""

    step_s: float
    """The whole training step: forward, loss, backward, optimizer step."""
    forward_s: tuple[float, ...] = ()
    """Each block's forward (``workloads.blocks``); empty where not measured."""
    backward_s: tuple[float, ...] = ()
    """Each block's backward (input and weight gradients)."""

    def as_dict(self) -> dict[str, Any]:
        return {"step_s": self.step_s, "forward_s": list(self.forward_s),
                "backward_s": list(self.backward_s)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BatchCosts:
        return cls(float(d["step_s"]), tuple(float(v) for v in d.get("forward_s") or ()),
                   tuple(float(v) for v in d.get("backward_s") or ()))


@dataclass(frozen=True)
class Calibration:
    """A workload's calibrated costs (module docstring)."""

    optimizer_s: float
    """The whole model's optimizer step, alone."""
    alone: Mapping[int, BatchCosts] = field(default_factory=dict)
    """Batch -> its costs on one device, the others idle."""
    together: Mapping[int, BatchCosts] = field(default_factory=dict)
    """Batch -> its costs on each device while every device computes (the slowest device's
    step; each block's mean over the devices)."""
    devices: int = 1
    """How many devices computed together."""
    wall_s: float = 0.0
    """How long the calibration took, process start included."""
    copies: Mapping[int, float] = field(default_factory=dict)
    """Bytes -> seconds to copy them into a freshly allocated buffer, every device at once
    (the slowest): the rate of FSDP2's copies around its collectives (``fsdp_copies_s``)."""
    parts_s: Mapping[str, float] = field(default_factory=dict)
    """Where ``wall_s`` went, part by part in the order they ran (``calibration.parts_of``:
    ``process_start_s``, ``cuda_context_s``, ``process_group_s``, ``model_build_s``, each
    size's ``alone_B_warmup_s`` and ``alone_B_timed_s``, ``optimizer_passes_s``,
    ``together_B_*``, ``blocks_B_s``, ``copies_s``, ``finish_s``, ``teardown_s``), seconds;
    they add up to ``wall_s``. In calibration.json, ``[name, seconds]`` pairs; none in one
    written before they were recorded."""
    steps: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """Each timed size's warm-up and timed passes (``alone_B``, ``together_B``)."""

    def as_dict(self) -> dict[str, Any]:
        return {"optimizer_s": self.optimizer_s, "devices": self.devices,
                "wall_s": round(self.wall_s, 3),
                "alone": {str(b): c.as_dict() for b, c in sorted(self.alone.items())},
                "together": {str(b): c.as_dict() for b, c in sorted(self.together.items())},
                "copies": {str(b): s for b, s in sorted(self.copies.items())},
                # Pairs, not an object: the file's keys are written sorted.
                "parts_s": [[name, s] for name, s in self.parts_s.items()],
                "steps": {k: list(v) for k, v in self.steps.items()}}

    def covers(self, sizes: Sizes) -> bool:
        """Whether this calibration measured every size in ``sizes`` (a calibration taken
        from another run serves only a sweep whose sizes it measured)."""
        blocks = {b for b, c in self.together.items() if c.forward_s}
        return (sizes.alone <= set(self.alone) and sizes.together <= set(self.together)
                and sizes.blocks <= blocks and sizes.copies <= set(self.copies))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Calibration:
        return cls(float(d["optimizer_s"]),
                   {int(b): BatchCosts.from_dict(c) for b, c in (d.get("alone") or {}).items()},
                   {int(b): BatchCosts.from_dict(c)
                    for b, c in (d.get("together") or {}).items()},
                   int(d.get("devices") or 1), float(d.get("wall_s") or 0.0),
                   {int(b): float(v) for b, v in (d.get("copies") or {}).items()},
                   {str(k): float(v) for k, v in d.get("parts_s") or ()},
                   {str(k): (int(v[0]), int(v[1])) for k, v in (d.get("steps") or {}).items()})


@dataclass(frozen=True)
class Sizes:
    """The batch sizes a calibration measures: alone, together, and with block times."""

    alone: frozenset[int] = frozenset()
    together: frozenset[int] = frozenset()
    blocks: frozenset[int] = frozenset()
    copies: frozenset[int] = frozenset()
    """Byte counts whose copy into a fresh buffer is timed (fsdp's: ``FRESH_COPY_BYTES``)."""

    def __or__(self, other: Sizes) -> Sizes:
        return Sizes(self.alone | other.alone, self.together | other.together,
                     self.blocks | other.blocks, self.copies | other.copies)

