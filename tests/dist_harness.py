"""A small harness for distributed tests: fresh gloo ranks, ``file://`` rendezvous, timeouts.

    results = run_ranks(fn, world_size=2, args=(...,))

``fn(rank, world_size, *args)`` runs in a spawned process after the process group is up
(``group=False``: with none, for code that starts its own, as the worker does); its return
value (picklable) comes back in rank order. A rank that raises, or a test
that exceeds ``timeout_s``, fails with the rank's error.

Ranks are fresh processes forked by multiprocessing's fork server, which imports torch and
the library once per test session (``PRELOAD``): a spawned rank paid seconds of imports
each time, two ranks a test. The server runs no torch operation, so a forked rank starts
with no thread pool to inherit (as ``bench_lib.processes.forkserver_process``'s ranks do). Its
environment is the test session's at its start: a rank sets what it needs itself.
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from queue import Empty

import torch.distributed as dist
import torch.multiprocessing as mp

GROUP_TIMEOUT_S = 60
PRELOAD = ["torch", "torch.distributed", "torchvision", "bench_lib.strategies",
           "bench_lib.workloads", "tests.dist_harness"]
"""Imported once in the fork server (with the test session's sys.path), so that a rank
only imports its test module."""


def _entry(rank, world_size, init_file, fn, args, queue, group=True):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        if not group:
            queue.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
            return
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
        )
        try:
            # Plain pickle copies tensor data; torch's queue reduction would share memory
            # that disappears when this process exits.
            queue.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
        raise


def run_ranks(fn: Callable, world_size: int = 2, args: tuple = (), timeout_s: float = 180,
              group: bool = True):
    """Run ``fn`` on ``world_size`` gloo ranks; return their results in rank order."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_entry, args=(r, world_size, init_file, fn, args, queue, group))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        # Read results before joining: a rank cannot exit until its pipe is drained.
        deadline = time.monotonic() + timeout_s
        results, errors = {}, []
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, value = queue.get(timeout=min(remaining, 1.0))
            except Empty:
                if not any(p.is_alive() for p in procs) and queue.empty():
                    break
                continue
            if status == "error":
                errors.append(f"rank {rank} failed:\n{value}")
            else:
                results[rank] = pickle.loads(value)
        for p in procs:
            p.join(max(deadline - time.monotonic(), 1))
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join()
        if errors:
            raise AssertionError("\n".join(errors))
        if alive:
            raise AssertionError(f"{len(alive)} rank(s) still running after {timeout_s} s")
        missing = sorted(set(range(world_size)) - set(results))
        if missing:
            codes = [p.exitcode for p in procs]
            raise AssertionError(f"ranks {missing} returned nothing (exit codes {codes})")
        return [results[r] for r in range(world_size)]
