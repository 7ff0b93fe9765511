"""The CUDA caching allocator's model (prediction.allocator) and what a GPU adds to a counted step
(prediction.cuda_memory), against hand counts of torch's rules."""

from __future__ import annotations

import pytest

from bench_lib.prediction import memory
from bench_lib.prediction.allocator import (
    MIB,
    CachingAllocator,
    block_size,
    replay,
    segment_size,
)
from bench_lib.prediction.cuda_memory import CUBLAS_WORKSPACE_BYTES, cublas_workspace_bytes
from bench_lib.prediction.fake_step import Program, simulate
from bench_lib.rig import Rig
from bench_lib.sweep.cases import new_case
from bench_lib.workloads import Workload

KIB = 2**10


@pytest.mark.parametrize(("nbytes", "block"), [
    (0, 512), (1, 512), (512, 512), (513, 1024), (1000 * KIB + 1, 1000 * KIB + 512)])
def test_a_request_takes_a_block_of_whole_512_byte_units(nbytes, block):
    assert block_size(nbytes) == block


@pytest.mark.parametrize(("block", "segment"), [
    (512, 2 * MIB),                    # the small pool: 2 MiB segments
    (MIB, 2 * MIB),
    (MIB + 512, 20 * MIB),             # 1-10 MiB: a 20 MiB segment, to be shared
    (10 * MIB - 512, 20 * MIB),
    (10 * MIB, 10 * MIB),              # from 10 MiB: its own, rounded up to 2 MiB
    (10 * MIB + 512, 12 * MIB),
    (25 * MIB, 26 * MIB)])
def test_a_block_no_cached_one_fits_gets_a_segment_by_its_size(block, segment):
    assert segment_size(block) == segment


def test_small_requests_share_two_mib_segments():
    """Three 600 KiB tensors fit one 2 MiB segment (the rest, 248 KiB, is split off and
    cached); the fourth takes a second segment."""
    alloc = CachingAllocator()
    for _ in range(4):
        alloc.malloc(600 * KIB)
    assert alloc.allocated == 4 * 600 * KIB
    assert alloc.reserved == 4 * MIB


def test_a_large_blocks_slack_of_a_mib_or_less_is_not_split_off_and_counts_as_allocated():
    """21 MiB takes a 22 MiB segment whose last MiB is not split off (the large pool splits
    only more than 1 MiB): allocated reads 22 MiB. 20 MiB in a 22 MiB block is split."""
    alloc = CachingAllocator()
    block = alloc.malloc(21 * MIB)
    assert (alloc.allocated, alloc.reserved) == (22 * MIB, 22 * MIB)
    alloc.free(block)
    alloc.malloc(20 * MIB)  # the cached 22 MiB block, 2 MiB split off
    assert (alloc.allocated, alloc.reserved) == (20 * MIB, 22 * MIB)


def test_freed_neighbours_merge_and_the_best_fit_is_reused():
    """4, 4 and 8 MiB blocks from one 20 MiB segment, 4 MiB of it left free. The first two
    freed merge into one 8 MiB block; a 3 MiB request takes the best fit, the 4 MiB rest
    (its last MiB not split off), and a 7 MiB one the merged 8 MiB: nothing new reserved
    (unmerged, or the 3 MiB cut from the 8, a new segment would be)."""
    alloc = CachingAllocator()
    a, b = alloc.malloc(4 * MIB), alloc.malloc(4 * MIB)
    alloc.malloc(8 * MIB)
    alloc.free(a)
    alloc.free(b)
    alloc.malloc(3 * MIB)
    alloc.malloc(7 * MIB)
    assert (alloc.allocated, alloc.reserved) == (20 * MIB, 20 * MIB)


def test_a_replayed_step_frees_the_last_steps_gradients_as_it_starts():
    """A step that makes a 10 MiB gradient (kept) and a 20 MiB transient: the measured
    step starts with the last step's gradient live (the peaks' reset comes before
    zero_grad), frees it, then peaks at 30 MiB; the segments are reused, 30 MiB."""
    events = [("alloc", 10 * MIB), ("alloc", 20 * MIB), ("free", 1)]
    peaks = replay([], events)
    assert (peaks.allocated, peaks.reserved) == (30 * MIB, 30 * MIB)
    # A 4 MiB input takes a 20 MiB segment, whose rest the 10 MiB gradient takes.
    held = replay([4 * MIB], events)
    assert (held.allocated, held.reserved) == (34 * MIB, 40 * MIB)


def test_a_convolutions_workspace_comes_on_top_of_what_is_live_there():
    events = [("alloc", 10 * MIB), ("conv", 0), ("free", 0)]
    assert replay([], events).allocated == 10 * MIB
    assert replay([], events, conv_workspace=16 * MIB).allocated == 26 * MIB


@pytest.mark.parametrize(("config", "nbytes"), [
    (None, CUBLAS_WORKSPACE_BYTES), (":4096:8", 32 * MIB),
    (":4096:2:16:8", 8 * MIB + 128 * KIB), (":16:8", 128 * KIB), ("nonsense", 32 * MIB)])
def test_cublas_workspace_is_torchs_reading_of_its_config(config, nbytes):
    env = {} if config is None else {"CUBLAS_WORKSPACE_CONFIG": config}
    assert cublas_workspace_bytes(env) == nbytes


def test_the_trace_adds_up_to_the_counted_peak():
    """The fake step's trace, summed in order over what it holds, peaks where the count
    does: it is the count's own record of allocations and frees."""
    w = Workload("resnet-tiny", 64, 8)
    f = simulate(Program(w, (), (0,), (8,), (("F", 0, 0), ("B", 0, 0))))
    sizes = [n for kind, n in f.trace if kind == "alloc"]
    live = peak = sum(f.held_sizes)
    for kind, value in f.trace:
        live += value if kind == "alloc" else -sizes[value] if kind == "free" else 0
        peak = max(peak, live)
    assert (peak, sum(f.held_sizes)) == (f.peak, f.held)
    assert any(kind == "conv" for kind, _ in f.trace)


def test_only_a_process_that_runs_a_matmul_gets_cublas_workspaces():
    """resnet-tiny's head is its one linear layer: the whole model's forward and backward
    each run it (two threads, two workspaces); a first stage without it runs none."""
    w = Workload("resnet-tiny", 64, 8)
    whole = simulate(Program(w, (), (0,), (8,), (("F", 0, 0), ("B", 0, 0))))
    first = simulate(Program(w, (2,), (0,), (8,), (("F", 0, 0), ("B", 0, 0))))
    assert (whole.matmul_threads, first.matmul_threads) == (2, 0)


def test_a_gpu_prediction_is_the_count_through_the_allocator_and_a_cpu_one_is_not():
    cuda = Rig("cuda", 1)
    case = new_case(cuda, "single", "resnet-tiny", 64, 8)
    counted = memory.counted_mib(case, cuda)["0"]
    p = memory.predict(case, cuda)
    workspaces = 2 * CUBLAS_WORKSPACE_BYTES / MIB
    assert counted + workspaces < p.max_mib < p.reserved_max_mib
    cpu = Rig("cpu", 2, 1, (0, 1))
    on_cpu = memory.predict(new_case(cpu, "single", "resnet-tiny", 64, 8), cpu)
    assert on_cpu.reserved_mib_by_device == on_cpu.mib_by_device
