"""Starting processes that never outlive their parent: ``lifeline`` (the parent-death signal,
a light exit) and ``forkserver`` (one process imports torch once and forks every other).
Torch-free; the runner (``run``) and the instruments that run in processes of their own
(``measure.flops``, ``measure.collectives``, ``measure.preflight``) both start theirs here.
"""
