"""The rig's collectives a sweep's bounds and predictions are priced with: env.json's
record, or the collective micro-benchmark (``measure.collectives``) run once per run, and
beside it, where mp or pipeline hand tensors between two GPUs in one process, the device
copy's probe (``measure.device_copy``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from bench_lib.analysis.bound import MOVING_ACROSS_GPUS, PRICED_WITH_COLLECTIVES
from bench_lib.analysis.collective_fits import Collectives
from bench_lib.rig import Rig
from bench_lib.workloads.sizes import parameter_bytes

if TYPE_CHECKING:
    from bench_lib.processes.forkserver import ForkServer
    from bench_lib.sweep.cases import Case


def sweep_collectives(rig: Rig, quiet: bool, cases: list[Case], server: ForkServer | None,
                      recorded: Mapping[str, Any] | None = None) -> Collectives:
    """The rig's collectives for a sweep's bounds and predictions: as ``recorded`` in
    env.json, else measured now, once per run, up to the largest message of ``cases``
    (``measure.collectives``; skipped where no case is priced with them), with the device
    copy where a case of ``cases`` hands tensors between two GPUs in one process."""
    import sys
    from dataclasses import replace

    from bench_lib.measure import collectives, device_copy

    if recorded is not None:
        return Collectives.from_dict(recorded)
    largest = largest_message(cases, rig)
    if largest is None:
        return Collectives(skipped="no case of the sweep to run is priced with collectives "
                                   "(ddp, fsdp, pipelines)")
    if not quiet:
        print("measuring collectives ...", file=sys.stderr, flush=True)
    sizes = collectives.sizes_for(largest)
    found = collectives.measure(rig, sizes, server=server)
    if not quiet:
        print(f"collectives: {found.bandwidth_line()}", file=sys.stderr)
    one_process = any(c.status is None and c.strategy in MOVING_ACROSS_GPUS for c in cases)
    if one_process and _moves_between_gpus(rig):
        fit, why = device_copy.measure(rig, sizes, server=server)
        found = replace(found, device_copy=fit, copy_skipped=why)
        if not quiet:
            print(found.copy_line(), file=sys.stderr)
    return found


def largest_message(cases: Iterable[Case], rig: Rig) -> int | None:
    """The most bytes one collective of the sweep's bounds moves (the largest model's
    gradients: activations are smaller), or None where no case to run is priced with the
    collective micro-benchmark (then it is not run)."""
    priced = PRICED_WITH_COLLECTIVES | (MOVING_ACROSS_GPUS if _moves_between_gpus(rig)
                                        else set())
    models = {(c.model, c.image_size) for c in cases
              if c.status is None and c.world_size > 1 and c.strategy in priced}
    return max((parameter_bytes(m, i)[0] for m, i in models), default=None)


def _moves_between_gpus(rig: Rig) -> bool:
    """Whether mp's and pipeline's hand-offs move tensors between two devices of the rig (not
    two slots of one GPU)."""
    return rig.num_devices > 1 and rig.moves_between(0, 1)
