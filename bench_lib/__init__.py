"""parabench: honest benchmarks of PyTorch training parallelism on GPU and CPU rigs."""

__version__ = "0.1.0"
TAKES_TURNS = 1
"""A checkout whose package says this steps in turns with the gate's other side where the
gate asks (``bench_lib.turns``): the gate reads it from each side before running
the two at once (``bench_lib.gate.sides``). Older checkouts lack it and run one at a time."""
