"""Learning parity: does every strategy train the same model as ``single``, on real data?

- ``data``: the datasets (scikit-learn's handwritten digits, shipped inside the package, or
  the user's MNIST / CIFAR-10; ``toy``'s seeded teacher regression) and the loaders every
  strategy shares;
- ``train``: one rank of one strategy's training run (a fresh process, like a case's);
- ``launch``: a run's rank processes, and the side-by-side runs of a cpu rig;
- ``verdict``: what BatchNorm normalises over, the tolerances (float32 rounding; single's
  spread over seeds) and the verdict per strategy;
- ``plan``: ``ParityPlan``, what the flags ask for, validated;
- ``check``: the command (``run_parity``): every strategy of every model, ``parity.csv`` and
  the verdicts.
"""
