"""A cpu worker's pinning to its own cores, and the heap it keeps.

A cpu worker keeps its heap (``keep_heap``): memory it frees stays its own for the next
pass, as a GPU's caching allocator keeps device memory, rather than going back to the
system and being paged in afresh.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable
from typing import Any

import torch

from bench_lib.rig import Rig


def pin_worker(rig: Rig, index: int) -> None:
    """Pin this process to CPU worker ``index``'s cores, with that worker's thread count.

    A process that drives several CPU "devices" (``mp``, ``pipeline``) is pinned like
    ``single``, to its first device's worker: its stages run one after another, so one
    worker's cores is what it can use, and pinning it to more would let its one busy
    thread migrate over cores that another case's worker would own.
    """
    if rig.kind != "cpu":
        return
    cores = rig.cores_of(index)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(rig.threads_per_worker)
    # Inter-op threads would add parallelism the rig does not promise.
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set once in this process; harmless
        pass
    keep_heap()


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
"""glibc's ``mallopt`` parameters (malloc.h)."""

KEPT_HEAP = "kept: glibc mallopt M_MMAP_MAX 0, M_TRIM_THRESHOLD 2**31 - 1"
"""What ``keep_heap`` does where it can (env.json ``cpu_heap``)."""


def keep_heap(libc: Any = None) -> str:
    """Make this process keep the memory it frees, for a cpu worker; returns what was done
    (``KEPT_HEAP``, or why not: ``heap_policy``).

    glibc by default serves big blocks by ``mmap`` and unmaps them when freed, under a
    threshold that moves with the sizes freed, and gives the top of its heap back past a
    second one, so a pass may page its buffers in afresh every time (ResNet50 at 64 px: a
    pipeline stage's 45 MiB of layer4 and fc gradients each backward, 30 ms of a 99 ms
    pass; the tutorial pipeline's held micro-batches, 375 MiB a step, on a 2-core AMD
    EPYC), depending on the order of allocations rather than on the strategy. No ``mmap``
    and no trimming keep every freed block in the heap for reuse, as a GPU's caching
    allocator does and as torch's own cpu launcher (``torch.backends.xeon.run_cpu``) does
    with jemalloc or tcmalloc.

    What it costs: a heap that gives nothing back fragments where a strategy frees buffers
    of many sizes. FSDP2's gathered buffers raised fsdp's peak at 64 px from 617 to 933 MiB
    (96 px: 682 to 1014; one run each, 2-core AMD EPYC), which the memory prediction does
    not count. A fixed 32 MiB mmap threshold instead (glibc's largest) kept fsdp's peak near
    the default's, but paged its bigger gathered buffers in afresh and the rest not, which
    the copy rate the calibration times (one size) cannot price: fsdp's waterfall remainder
    went from -6% to -29% (#41)."""
    mallopt = _mallopt(libc)
    if isinstance(mallopt, str):
        return mallopt
    if not (mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, 2**31 - 1)):
        return "the C library's own: it refused mallopt"
    return KEPT_HEAP


def heap_policy(libc: Any = None) -> str:
    """What ``keep_heap`` does in a cpu worker here, without doing it (env.json
    ``cpu_heap``): ``KEPT_HEAP``, or the C library's own ways and why."""
    found = _mallopt(libc)
    return found if isinstance(found, str) else KEPT_HEAP


def _mallopt(libc: Any) -> Callable[[int, int], int] | str:
    if libc is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c"))
        except (OSError, TypeError) as e:  # TypeError: no C library found by that name
            return f"the C library's own: {e}"
    found = getattr(libc, "mallopt", None)
    return found if found is not None else "the C library's own: it has no mallopt"
