"""``single``'s batch curve: its step time at each per-device batch the sweep's cases
compute, so that a device's loss with fewer images at once is measured, not assumed. Its
points are copies of a workload's ``single`` case at the smaller batches (``batch_curve``),
measured in that workload's rounds; a point that only split candidates compute carries
their search (``curve_searches``), and is skipped when none of them is measured
(``splits.unmeasured``).
"""

from __future__ import annotations

import dataclasses

from bench_lib.sweep.cases import Case


def curve_users(point: Case, cases: list[Case]) -> list[Case]:
    """The cases to run that compute ``point``'s batch on one device (its model, image size,
    precision and loss): what a batch-curve point is measured for."""
    return [c for c in cases if c.status is None and c.curve_of is None
            and (c.model, c.image_size, c.precision, c.loss)
            == (point.model, point.image_size, point.precision, point.loss)
            and c.device_batch_size == point.batch_size]


def curve_searches(cases: list[Case], points: list[Case]) -> list[Case]:
    """The batch-curve points, each that only split candidates compute carrying the search
    most likely to measure one of them (the largest share measured)."""
    out = []
    for point in points:
        searches = [c.split_search for c in curve_users(point, cases)]
        if searches and all(searches):
            found = [s for s in searches if s is not None]
            best = max(found, key=lambda s: s.measured / max(s.candidates, 1))
            point = dataclasses.replace(point, split_search=best)
        out.append(point)
    return out


def batch_curve(cases: list[Case]) -> list[Case]:
    """``single`` at every per-device batch (``Case.device_batch_size``) that the cases to
    run compute and no ``single`` case among them measures: the points of each workload's
    batch curve, each a copy of that workload's ``single`` case at the smaller batch
    (``curve_of``: the workload's batch). A workload without a ``single`` case to run has
    none. A batch two workloads share is measured once, for the first."""
    singles = {c.workload_key: c for c in cases if c.strategy == "single" and c.status is None}
    points: dict[tuple[str, int, int, str, str], Case] = {}
    for case in cases:
        parent = singles.get(case.workload_key)
        if case.status is not None or parent is None:
            continue
        point = dataclasses.replace(parent, batch_size=case.device_batch_size,
                                    curve_of=parent.batch_size)
        if point.workload_key not in singles:
            points.setdefault(point.workload_key, point)
    return list(points.values())
