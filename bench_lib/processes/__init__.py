"""Starting processes that never outlive their parent: ``lifeline`` (the parent-death signal,
a light exit), the fork server (one process imports torch once, the modules its caller
names, and forks every other: ``forkserver`` is the side that starts it and asks it for
processes, ``forkserver_process`` the server itself, ``resident_pages`` what makes a forked
child's memory read as a fresh one's) and ``supervision`` (a launch's processes in a group
of their own, started, supervised and killed). Torch-free, and importing nothing of
``bench_lib`` above it; the runner (``run``), the instruments that run in processes of their
own (``measure.flop_peak``, ``measure.collectives``, ``measure.preflight_probes``), ``parity`` and
``distance`` all start theirs here.
"""
