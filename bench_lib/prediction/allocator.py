"""PyTorch's CUDA caching allocator, replayed on one training step's allocations.

On a GPU the memory a case is measured by is not the bytes of its live tensors (what
``prediction.fake_step`` counts) but the allocator's blocks and segments
(``c10/cuda/CUDACachingAllocator.cpp``, torch 2.x with its defaults: no
``max_split_size_mb``, no expandable segments, no ``empty_cache``):

- a request is rounded up to a multiple of 512 bytes (``block_size``);
- a block found free is split only where what is left is worth keeping: at least 512 bytes
  in the small pool, more than 1 MiB in the large one; an unsplit block's slack counts as
  allocated (``max_memory_allocated``: the blocks, not the tensors);
- what no free block fits is a new segment from the device (``segment_size``): requests of
  up to 1 MiB share 2 MiB segments (the small pool), requests under 10 MiB take 20 MiB,
  larger ones their size rounded up to 2 MiB;
- freed blocks are cached, merged with free neighbours of their segment, and reused best
  fit (the smallest free block that holds the request, lowest address first); segments are
  never given back, so ``max_memory_reserved`` keeps every segment the step ever needed,
  the free parts no later request fits included (fragmentation).

``replay`` runs a step's trace as the worker runs steps: ``warmup_steps`` steps, the peaks
reset (the worker's ``PeakMemory.reset``), then one step measured; each step starts by
freeing the gradients the step before left (``zero_grad(set_to_none=True)``).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

KIB, MIB = 2**10, 2**20
MIN_BLOCK = 512
"""Every request is rounded up to a multiple of this (``kMinBlockSize``)."""
SMALL_SIZE = MIB
"""Requests up to this come from the small pool (``kSmallSize``)."""
SMALL_BUFFER = 2 * MIB
"""The small pool's segment (``kSmallBuffer``)."""
LARGE_BUFFER = 20 * MIB
"""The segment of a request between ``SMALL_SIZE`` and ``MIN_LARGE_ALLOC`` (``kLargeBuffer``)."""
MIN_LARGE_ALLOC = 10 * MIB
"""From this size a request's segment is its own size, rounded (``kMinLargeAlloc``)."""
ROUND_LARGE = 2 * MIB
"""A large segment's rounding (``kRoundLarge``)."""

Event = tuple[str, int]
"""One step of a trace: ``("alloc", bytes)``, ``("free", i)`` (the step's i-th allocation,
from 0), or ``("conv", 0)`` (a convolution ran: its cuDNN workspace is allocated and freed
there, after its outputs)."""


def block_size(nbytes: int) -> int:
    """The block a request of ``nbytes`` takes: rounded up to 512 bytes (512 at least)."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(block: int) -> int:
    """The segment the allocator asks the device for when no free block fits ``block``."""
    if block <= SMALL_SIZE:
        return SMALL_BUFFER
    if block < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-block // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class Block:
    """A piece of a segment, free or handed out; neighbours within the segment linked."""

    addr: int
    size: int
    small: bool
    free: bool = False
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)


class CachingAllocator:
    """The allocator's bookkeeping (module docstring), in bytes; no memory behind it."""

    def __init__(self) -> None:
        self._pools: dict[bool, list[tuple[int, int, Block]]] = {True: [], False: []}
        self._next_addr = itertools.count(step=2**40)  # segments never touch
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    def malloc(self, nbytes: int) -> Block:
        """Hand out a block for ``nbytes``: the best cached fit, split, or a new segment."""
        size = block_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._pools[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            block = pool.pop(i)[2]
        else:
            block = Block(next(self._next_addr), segment_size(size), small)
            self.reserved += block.size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            tail = Block(block.addr + size, rest, small, True, block, block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._cache(tail)
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: Block) -> None:
        """Take ``block`` back: merged with free neighbours, cached."""
        self.allocated -= block.size
        block.free = True
        prev, nxt = block.prev, block.next
        if prev is not None and prev.free:
            self._uncache(prev)
            prev.size += block.size
            prev.next = nxt
            if nxt is not None:
                nxt.prev = prev
            block = prev
        if nxt is not None and nxt.free:
            self._uncache(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
        self._cache(block)

    def reset_peaks(self) -> None:
        """The peaks from now on (``torch.cuda.reset_peak_memory_stats``)."""
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def _cache(self, block: Block) -> None:
        bisect.insort(self._pools[block.small], (block.size, block.addr, block))

    def _uncache(self, block: Block) -> None:
        pool = self._pools[block.small]
        del pool[bisect.bisect_left(pool, (block.size, block.addr))]


@dataclass(frozen=True)
class Peaks:
    """What the allocator reports over the measured step, bytes."""

    allocated: int
    """``torch.cuda.max_memory_allocated``: the peak of blocks handed out."""
    reserved: int
    """``torch.cuda.max_memory_reserved``: the peak of segments held from the device."""


def replay(held: Sequence[int], events: Sequence[Event], warmup_steps: int = 2,
           conv_workspace: int = 0) -> Peaks:
    """The allocator's peaks over a measured step (module docstring).

    ``held``: bytes of each allocation made before the first step and kept (parameters,
    inputs, buffers, library workspaces); ``events``: one step's trace (``Event``); an
    allocation the step does not free is kept until the next step starts (a gradient);
    ``conv_workspace``: bytes allocated and freed at each ``("conv", 0)``.
    """
    alloc = CachingAllocator()
    for nbytes in held:
        alloc.malloc(nbytes)
    allocations = sum(1 for kind, _ in events if kind == "alloc")
    kept_ids = set(range(allocations)) - {i for kind, i in events if kind == "free"}
    kept: list[Block] = []
    for step in range(warmup_steps + 1):
        if step == warmup_steps:
            alloc.reset_peaks()  # after warm-up, before the next step's zero_grad
        for block in kept:
            alloc.free(block)
        kept = _step(alloc, events, kept_ids, conv_workspace)
    return Peaks(alloc.peak_allocated, alloc.peak_reserved)


def _step(alloc: CachingAllocator, events: Sequence[Event], kept_ids: set[int],
          conv_workspace: int) -> list[Block]:
    """Run one step's ``events``; returns the blocks it keeps (``kept_ids``)."""
    kept: list[Block] = []
    live: dict[int, Block] = {}
    index = itertools.count()
    for kind, value in events:
        if kind == "alloc":
            i, block = next(index), alloc.malloc(value)
            if i in kept_ids:
                kept.append(block)
            else:
                live[i] = block
        elif kind == "free":
            alloc.free(live.pop(value))
        elif conv_workspace:
            alloc.free(alloc.malloc(conv_workspace))
    return kept
