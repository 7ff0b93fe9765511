"""parabench: honest benchmarks of PyTorch training parallelism on GPU and CPU rigs."""

__version__ = "0.1.0"
