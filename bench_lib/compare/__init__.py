"""THE GATE: a candidate run against a baseline, case by case, from their files only.

``gate`` (the statistics and the verdict rule), ``baseline`` (the store of baselines by
hardware fingerprint) and ``output`` (the ``compare`` command: table, Markdown, JSON, and
``gate()``, which ``run --compare-to`` calls too). Never imports torch.
"""
