"""A control for the machine's speed: a short fixed piece of work timed just before every
timed step of a cpu rig's launch (``timing.time_steps``), in steps.csv's ``probe_s``.

A shared CPU's speed moves within seconds, every process on it alike (docs/methodology.md,
"What the noise is made of": on 2 Intel Xeon cores a launch's 8 steps ran at 0.72-0.74 s,
the next launch's at 0.58-0.67 s). The probe, timed at the same moment as the step, moves with
it: so a step over its probe keeps what the step's own code does and loses most of what the
machine did (``compare.runs``, ``gate``). Its code never changes with the code measured: it is
a few matrix products of fixed size, and ``PROBE`` names them so that a gate compares two
sides' probes only where both ran this one.

Each rank times it on its own core(s) in the rank's own threads, in about 6 ms (1% of a
ResNet50 step at 64 px; measured on 2 Intel Xeon cores), outside the step's time. Readers use
it for cases one process times (``compare.runs.ONE_PROCESS_PROBES``: a rank of several
probes while its peer still works, and times that work too). Not on
GPUs: a GPU's step does not run on the cores a CPU probe would time, and a GPU's clocks are
read through NVML (``throttled``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

PROBE = "gemm fp32 384x384 x8"
"""What the probe does, recorded in env.json (``speed_probe``): a gate uses the probes only
where both sides ran the same one."""
SIZE, PRODUCTS = 384, 8


def make_probe() -> Callable[[], float]:
    """The probe on this process's CPU: a call runs it and returns its seconds."""
    import torch

    generator = torch.Generator().manual_seed(0)
    a = torch.randn(SIZE, SIZE, generator=generator)
    b = torch.randn(SIZE, SIZE, generator=generator)
    out = torch.empty(SIZE, SIZE)

    def probe() -> float:
        t0 = time.perf_counter()
        for _ in range(PRODUCTS):
            torch.mm(a, b, out=out)
        return time.perf_counter() - t0

    probe()  # its first call pays for the allocator and the kernel's choice
    return probe
