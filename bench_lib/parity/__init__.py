"""Learning parity: does every strategy train the same model as ``single``, on real data?

- ``data``: the datasets (scikit-learn's handwritten digits, shipped inside the package;
  ``toy``'s seeded teacher regression) and the loaders every strategy shares;
- ``train``: one rank of one strategy's training run (a fresh process, like a case's);
- ``verdict``: the tolerance, derived from float32 rounding, and the verdict per strategy;
- ``run``: the command: every strategy of every model, ``parity.csv`` and the verdicts.
"""
