"""A profile expanded on a rig into the sweep's cases, before anything runs: checked
(``validate``), each combination of its grid made a case (``cases.new_case``), a split
search's candidates marked (``splits.searched``), ``single``'s batch-curve points added
(``batch_curve``), in run order (``baselines_first``); its workload groups
(``workload_groups``).

A value that no case of the sweep can use is a usage error (``UsageError``: exit 2, nothing
written); a combination that some cases can use and others cannot is a ``skipped`` case.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from bench_lib import strategies
from bench_lib.rig import Rig
from bench_lib.sweep.batch_curve import batch_curve, curve_searches
from bench_lib.sweep.cases import Case, new_case
from bench_lib.sweep.profile import Profile, UsageError
from bench_lib.sweep.splits import searched, split_candidates


def validate(profile: Profile, rig: Rig) -> None:
    """Raise ``UsageError`` for values that no case of the sweep can use.

    A batch size that a data-parallel strategy's world size does not divide is an error only
    when nothing else of the sweep could run: otherwise those cases are ``skipped`` rows (a
    sweep for 7 GPUs runs ``single``, ``mp``... and says why ``ddp`` did not).
    """
    strats = [strategies.get(s) for s in profile.strategies]
    used = profile.used_batch_sizes or profile.batch_sizes
    if any(s.uses_split for s in strats):
        biggest = max(used)
        batches = ", ".join(map(str, used))
        if not profile.split_sizes and not profile.microbatches:
            raise UsageError("pipelined strategies need split sizes or micro-batch counts")
        for split in profile.split_sizes:
            if split > biggest:
                raise UsageError(
                    f"split size {split} is larger than every batch size ({batches}); "
                    f"use a split size <= {biggest}"
                )
        for count in profile.microbatches:
            if count > biggest:
                raise UsageError(
                    f"{count} micro-batches is more than every batch size ({batches}) holds; "
                    f"use a count <= {biggest}"
                )
    runnable = [s for s in strats if not s.unsupported_reason(rig)]
    indivisible = [s for s in runnable if s.data_parallel
                   and not any(b % s.num_devices(rig) == 0 for b in used)]
    if indivisible and len(indivisible) == len(runnable):
        world = indivisible[0].num_devices(rig)
        raise UsageError(
            f"no batch size ({', '.join(map(str, used))}) is divisible by "
            f"{indivisible[0].name}'s world size {world}; use a multiple of {world}"
        )


def expand(profile: Profile, rig: Rig) -> list[Case]:
    """The sweep's cases in run order (``baselines_first``), each marked to run, skipped
    or unsupported."""
    validate(profile, rig)
    cases: list[Case] = []
    grid = ((model, precision, image, batch, name)
            for model, precision in itertools.product(profile.models, profile.precisions)
            for image in profile.image_sizes_for(model)
            for batch in profile.batch_sizes_for(image)
            for name in profile.strategies)
    for model, precision, image, batch, name in grid:
        strat = strategies.get(name)
        micro: list[dict[str, int]] = [{}]
        if strat.uses_split and profile.split_search_for(name):
            micro = [{"split_size": s} for s in split_candidates(batch)]
        elif strat.uses_split:
            micro = ([{"split_size": s} for s in profile.split_sizes]
                     + [{"microbatch_count": m} for m in profile.microbatches])
        knob_sets = profile.ddp_knob_sets if strat.ddp_knobs else (None,)
        for scaling, partition, m, knobs in itertools.product(
                profile.scaling, profile.partitions if strat.uses_partition else (None,),
                micro, knob_sets):
            cases.append(new_case(
                rig, name, model, image, batch, precision, profile.loss, **m,
                partition=partition, channels_last=profile.channels_last,
                compile=profile.compile, sync_bn=profile.sync_bn, ddp=knobs,
                measurement=profile.measurement, scaling=scaling))
    unique: dict[str, Case] = {}
    # A split given twice (as a size and as a count) is one case; so is a one-device
    # strategy under both scalings.
    for case in cases:
        unique.setdefault(case.case_id, case)
    swept = list(unique.values())
    if any(profile.split_search_for(s) for s in profile.strategies):
        swept = searched(swept, profile)
    curve = batch_curve(swept) if profile.batch_curve else []
    return baselines_first(swept + curve_searches(swept, curve))


def baselines_first(cases: list[Case]) -> list[Case]:
    """The run order: each workload's ``single`` case, then its batch-curve points, then its
    other cases, strong before weak; workloads as first seen (``Case.group_key``), else as given.

    The speedup columns are filled as each row is written, against the ``single`` case of
    the same workload measured earlier in the run: a case run before its baseline gets none.
    """
    first: dict[tuple[str, int, int, str, str], int] = {}
    for i, case in enumerate(cases):
        first.setdefault(case.group_key, i)
    return sorted(cases, key=lambda c: (first[c.group_key], c.strategy != "single",
                                        c.curve_of is not None, c.scaling == "weak"))


def workload_groups(cases: Sequence[Case]) -> list[list[int]]:
    """Indices of the cases of each workload (``Case.group_key``: its batch-curve points
    with it), in first-seen order: the unit the runner measures in rounds (``run.runner``)
    and a shard takes whole (``run.shard``)."""
    groups: dict[tuple[str, int, int, str, str], list[int]] = {}
    for i, case in enumerate(cases):
        groups.setdefault(case.group_key, []).append(i)
    return list(groups.values())
