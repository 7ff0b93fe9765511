"""Starting processes that never outlive their parent: ``lifeline`` (the parent-death signal,
a light exit), ``forkserver`` (one process imports torch once, the modules its caller names,
and forks every other) and ``supervision`` (a launch's processes in a group of their own,
started, supervised and killed). Torch-free, and importing nothing of ``bench_lib`` above
it; the runner (``run``), the instruments that run in processes of their own
(``measure.flops``, ``measure.collectives``, ``measure.preflight``), ``parity`` and
``distance`` all start theirs here.
"""
