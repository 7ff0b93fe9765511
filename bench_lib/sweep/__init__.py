"""BEFORE anything runs, data only: profiles, their expansion into cases, duration estimates.

``profile`` (the grid and the typed ``Measurement``), ``cases`` (``Case``, ``new_case``),
``refusals`` (what torch or a model would refuse), ``expansion`` (``validate``, ``expand``,
the run order), ``splits`` (the split search), ``batch_curve`` (``single``'s batch-curve
points), ``estimate``, and the shipped ``profiles/*.toml``.
"""
