"""Where a launch's fixed cost goes: named parts from the ranks' stamps and the runner's.

A launch's wall time (``run_case``: from the case folder's creation to its removal) is its
timed steps, its warm-up steps, and its fixed cost, split here into parts::

    prepare | process start | cuda context | process group | model build | steps | diagnostics
    | teardown | sampler stop | collect      (+ unaccounted: what falls between them)

Each rank stamps named points on ``time.monotonic()`` (``stamp``, ``span``) and carries
them in its ``RankResult.stamps_s``. CLOCK_MONOTONIC is one clock for the whole host on
Linux (not per process), so a rank's stamps and the runner's can be subtracted: the
process start is the first rank's request (the runner's stamp) to the last rank's ``main``.
Across hosts (torchrun over several nodes) they cannot, and under torchrun the runner does
not see its ranks requested: there a part is the slowest rank's own span, and the process
start and teardown are absent, not zero-faked (``worker_parts``).

On one host each part is measured between the last rank's stamps (the later of the ranks'
starts to the later of their ends), not as the slowest rank's span: ranks run at once,
and a rank that waits in ``init_process_group`` for a late peer is waiting for that peer's
start, which the process start already counts. The last ranks' stamps only move forward
(each rank's stamps are in order), so the parts never overlap, and with the runner's parts
and the unaccounted rest (``with_unaccounted``) they add up to the launch's wall time
beyond its timed and warm-up steps. The rest can be slightly negative where one rank's
first warm-up step waited for a slower peer's model build (data-parallel ranks meet in
that step's collective): both the build and the warm-up count that wait.

Never imports torch: the worker imports it before torch, the runner and the duty cycle
read it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

MAIN = "main"
"""A rank's stamp as its ``worker.main`` starts (its imports done)."""
DONE = "done"
"""A rank's last stamp: just before it writes its final result."""
SPANS: dict[str, tuple[str, str]] = {
    "cuda_context_s": ("cuda_context_start", "cuda_context_end"),
    "process_group_s": ("process_group_start", "process_group_end"),
    "model_build_s": ("model_build_start", "model_build_end"),
    "diagnostics_s": ("diagnostics_start", DONE),
}
"""Each worker part and the two stamps that bound it. Between the model build's end and
the diagnostics' start lie the steps, warm-up and timed (the diagnostics start as
``measure_steps`` returns: everything after the timed steps is theirs)."""
RUNNER_PARTS = ("prepare_s", "sampler_s", "collect_s")
"""The runner's own parts of a launch (``case_launch.run_case``, ``case_launch._run_local``)."""
LAUNCH_PARTS = ("process_start_s", *SPANS, "teardown_s", *RUNNER_PARTS, "unaccounted_s")
"""Every part of a launch's fixed cost, in the order a launch goes through them."""

Stamps = dict[str, float]
"""Named ``time.monotonic()`` stamps of one rank."""


def stamp(stamps: Stamps, name: str) -> None:
    """Record ``name`` at the current monotonic time."""
    stamps[name] = time.monotonic()


@contextmanager
def span(stamps: Stamps, name: str) -> Iterator[None]:
    """Stamp ``<name>_start`` and, once the block ended without raising, ``<name>_end``."""
    stamp(stamps, f"{name}_start")
    yield
    stamp(stamps, f"{name}_end")


def worker_parts(ranks: Sequence[Mapping[str, float]], requested_s: float | None = None,
                 reaped_s: float | None = None) -> dict[str, float]:
    """A launch's parts from its ranks' stamps (module docstring), seconds.

    ``requested_s``: the runner's stamp as it asked for the first rank (the local launcher:
    one host, one clock); None: the ranks' clocks may not be the runner's (torchrun), each
    part is then the slowest rank's own span, and the process start and teardown are not
    measured. ``reaped_s``: when the runner had reaped every rank (the teardown's end). A
    part is given only where every rank stamped both its ends.
    """
    if not ranks:
        return {}
    one_clock = requested_s is not None
    parts: dict[str, float] = {}

    def latest(name: str) -> float:
        return max(r[name] for r in ranks)

    if one_clock and all(MAIN in r for r in ranks):
        assert requested_s is not None
        parts["process_start_s"] = latest(MAIN) - requested_s
    for part, (start, end) in SPANS.items():
        if all(start in r and end in r for r in ranks):
            parts[part] = (latest(end) - latest(start) if one_clock
                           else max(r[end] - r[start] for r in ranks))
    if one_clock and reaped_s is not None and all(DONE in r for r in ranks):
        parts["teardown_s"] = reaped_s - latest(DONE)
    return parts


def with_unaccounted(parts: Mapping[str, float], wall_s: float, timed_s: float,
                     warmup_s: float) -> dict[str, float]:
    """``parts`` and ``unaccounted_s``: the launch's wall time beyond its timed and warm-up
    steps that no part names, so that the parts add up to exactly that (signed: see the
    module docstring)."""
    named = {k: v for k, v in parts.items() if k != "unaccounted_s"}
    return named | {"unaccounted_s": wall_s - timed_s - warmup_s - sum(named.values())}
