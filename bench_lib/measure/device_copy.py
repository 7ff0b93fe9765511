"""One process's device-to-device copy, timed: what ``mp``'s and ``pipeline``'s ``.to()``
between two GPUs costs, fitted as t(n) = alpha + n / beta (``analysis.collective_fits``).

Beside the collectives (``prediction.collectives``), where device slots 0 and 1 are distinct
GPUs (``Rig.moves_between``) and a case of the sweep hands a tensor between them inside one
process (``analysis.bound.MOVING_ACROSS_GPUS``), one fresh process times ``t.to(device 1)``
of a tensor on device 0, and back, at each of the collectives' sizes: one warm-up, then
``REPEATS`` copies, each between a synchronisation of both devices, on the host's clock: the
copy as the one process waits on it, its dispatch included, as the collectives are timed.
The median per size and direction; both directions go into one fit (each size twice, 0 -> 1
then 1 -> 0: mp's activation goes one way, its gradient the other). The fit is env.json
``collectives.device_copy``; where the probe fails, ``collectives.device_copy.skipped``
says why, and the bounds and predictions assume ``collective_fits.ASSUMED_DEVICE_COPY``
and say so.

Not measured on a cpu rig: every slot is the one ``cpu`` device, and ``.to()`` to the
device a tensor is on returns the tensor itself, so mp's hand-off there copies nothing
(priced 0); nor between the slots of one GPU (``--gpu-slots``), for the same reason.

    python -m bench_lib.measure.device_copy RIG_JSON FOLDER SIZES_MIB REPEATS PARENT_PID
"""

# ruff: noqa: E402  (the lifeline is armed before torch's imports, as in launch.worker)
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench_lib.processes.lifeline import argv_pid, exit_if_orphaned, exit_lightly

if __name__ == "__main__":
    exit_if_orphaned(argv_pid(sys.argv, 5))

import torch

from bench_lib.analysis.collective_fits import MIB, CollectiveFit
from bench_lib.processes.forkserver import ForkServer, parent_pid, start_module
from bench_lib.rig import Rig, synchronize

REPEATS = 5
TIMEOUT_S = 60.0
"""The whole probe, process start included."""
CopyClock = Callable[[int, int, int], float]
"""(bytes, source slot, destination slot) -> one timed copy's seconds."""


def time_copies(sizes_bytes: Sequence[int], repeats: int, copy_s: CopyClock
                ) -> tuple[list[int], list[float]]:
    """The median of ``repeats`` timed copies (after one warm-up) at each size, 0 -> 1 then
    1 -> 0: the sizes and times ``CollectiveFit.of`` fits, each size twice."""
    sizes: list[int] = []
    times: list[float] = []
    for src, dst in ((0, 1), (1, 0)):
        for nbytes in sizes_bytes:
            copy_s(nbytes, src, dst)  # warm-up: the peer mapping, the allocator's first block
            sizes.append(nbytes)
            times.append(statistics.median(copy_s(nbytes, src, dst) for _ in range(repeats)))
    return sizes, times


def copy_clock(devices: Sequence[torch.device]) -> CopyClock:
    """Times one ``.to()`` of a float32 tensor of n bytes from ``devices[src]`` to
    ``devices[dst]``, both devices synchronised before and after."""
    made: dict[tuple[int, int], torch.Tensor] = {}

    def copy_s(nbytes: int, src: int, dst: int) -> float:
        key = (nbytes, src)
        if key not in made:
            made[key] = torch.ones(max(1, nbytes // 4), dtype=torch.float32,
                                   device=devices[src])
        synchronize(devices)
        t0 = time.perf_counter()
        moved = made[key].to(devices[dst])
        synchronize(devices)
        elapsed = time.perf_counter() - t0
        del moved
        return elapsed

    return copy_s


def measure(rig: Rig, sizes_mib: Sequence[float], repeats: int = REPEATS,
            timeout_s: float = TIMEOUT_S, server: ForkServer | None = None
            ) -> tuple[CollectiveFit | None, str]:
    """The copy fit between device slots 0 and 1, timed in a fresh process (forked by
    ``server`` where given), or None and why there is none."""
    if rig.num_devices < 2 or not rig.moves_between(0, 1):
        return None, "device slots 0 and 1 are one memory: .to() between them copies nothing"
    start = time.monotonic()
    sizes = ",".join(f"{s:g}" for s in sizes_mib)
    with tempfile.TemporaryDirectory(prefix="parabench-copy-") as folder:
        log = Path(folder) / "probe.log"
        proc = start_module(server, "bench_lib.measure.device_copy",
                            [json.dumps(rig.as_dict()), folder, sizes, str(repeats),
                             str(parent_pid(server))], log)
        while proc.poll() is None and time.monotonic() < start + timeout_s:
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        result = Path(folder) / "result.json"
        if proc.returncode != 0 or not result.is_file():
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-2:])
            why = (f"over {timeout_s:g} s" if time.monotonic() > start + timeout_s
                   else f"exited with {proc.returncode}: {tail}")
            return None, f"device copy probe failed ({why})"
        found = json.loads(result.read_text())
    return CollectiveFit.of("copy", 2, found["sizes_bytes"], found["times_s"]), ""


def main(argv: list[str]) -> int:
    """The probe process (``measure`` starts it): writes the sizes and times it timed."""
    from bench_lib.pinning import pin_worker

    rig, folder = Rig.from_dict(json.loads(argv[0])), Path(argv[1])
    pin_worker(rig, 0)  # as mp's one process is pinned
    sizes = [max(4, int(float(s) * MIB) // 4 * 4) for s in argv[2].split(",")]
    sizes, times = time_copies(sizes, int(argv[3]), copy_clock(rig.devices(2)))
    tmp = folder / "result.json.tmp"
    tmp.write_text(json.dumps({"sizes_bytes": sizes, "times_s": times}))
    tmp.rename(folder / "result.json")
    return 0


if __name__ == "__main__":
    exit_lightly(main(sys.argv[1:]))
