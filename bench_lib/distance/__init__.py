"""The pairwise-distance workload: several devices outside of training.

The accumulated distance between every pair of kernels of a large ``nn.Conv2d`` weight,
``sum_{p,q} ||X_p - X_q||``, kept differentiable, three ways, each a case timed like the
training cases:

- ``methods``: the math: the question's double Python loop, ``torch.cdist`` in blocks of
  rows on one device, the rows split over devices (one process) or ranks (a process group),
  and the float64 reference value and gradient in closed form;
- ``spec``: layer shapes, cases (what runs where, what is skipped) and what a launch's
  processes are told;
- ``worker``: one process of a launch (``python -m bench_lib.distance.worker``);
- ``launch``: one launch, supervised by the runner's rules;
- ``plan``: ``DistancePlan``, what the flags ask for, validated;
- ``benchmark``: the command (``run_distance``), ``python -m bench_lib distance``, writing
  ``distance.csv``.
"""
