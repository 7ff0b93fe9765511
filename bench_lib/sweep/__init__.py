"""BEFORE anything runs, data only: profiles, their expansion into cases, duration estimates.

``profile`` (the grid and the typed ``Measurement``), ``cases`` (``Case``, ``validate``,
``expand``), ``estimate``, and the shipped ``profiles/*.toml``.
"""
