"""The rig's collectives a sweep's bounds and predictions are priced with: env.json's
record, or the collective micro-benchmark (``measure.collectives``) run once per run, and
beside it, where mp or pipeline hand tensors between two GPUs in one process, the device
copy's probe (``measure.device_copy``); or those ``run --calibration``'s file recorded, where
they were measured for the same sweep (``reusable_collectives``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from bench_lib.analysis.bound import MOVING_ACROSS_GPUS, PRICED_WITH_COLLECTIVES
from bench_lib.analysis.collective_fits import MIB, OPS, Collectives
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
    planned = _planned(rig, cases)
    if planned is None:
        return Collectives(skipped="no case of the sweep to run is priced with collectives "
                                   "(ddp, fsdp, pipelines)")
    sizes, copies = planned
    if not quiet:
        print("measuring collectives ...", file=sys.stderr, flush=True)
    found = collectives.measure(rig, sizes, server=server)
    if not quiet:
        print(f"collectives: {found.bandwidth_line()}", file=sys.stderr)
    if copies:
        fit, why = device_copy.measure(rig, sizes, server=server)
        found = replace(found, device_copy=fit, copy_skipped=why)
        if not quiet:
            print(found.copy_line(), file=sys.stderr)
    return found


def reusable_collectives(rig: Rig, cases: list[Case],
                        given: Mapping[str, Any] | None) -> Collectives | None:
    """``given`` (the collectives ``run --calibration``'s file records, checked to come
    from this hardware and number of devices) where they were measured as
    ``sweep_collectives`` would measure them for ``cases`` now: on this backend and path,
    at the same sizes, with the device copy where a case needs it. None otherwise: the run
    measures its own. A gate's later rounds, each the same sweep, reuse their first's."""
    from bench_lib.measure.collectives import path_of

    planned = _planned(rig, cases)
    if given is None or planned is None:
        return None
    sizes, copies = planned
    found = Collectives.from_dict(given)
    top = sizes[-1] * MIB
    same = (not found.skipped and found.backend == rig.backend
            and found.world_size == rig.num_devices and found.path == path_of(rig)
            and set(found.fits) == set(OPS)
            and all(abs(max(f.sizes_bytes) - top) <= 0.01 * top for f in found.fits.values())
            and (found.device_copy is not None or not copies))
    return found if same else None


def _planned(rig: Rig, cases: list[Case]) -> tuple[tuple[float, ...], bool] | None:
    """The sizes (MiB) the collectives of a sweep of ``cases`` are timed at, and whether
    the device copy is timed too; None where nothing is (no case is priced with them)."""
    from bench_lib.measure.collectives import sizes_for

    largest = largest_message(cases, rig)
    if largest is None:
        return None
    one_process = any(c.status is None and c.strategy in MOVING_ACROSS_GPUS for c in cases)
    return sizes_for(largest), one_process and _moves_between_gpus(rig)


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
