"""Verdicts read from run folders: a candidate run against a baseline, case by case, and
the same-job gate's rounds, paired; from their files only.

``runs`` (the two run folders read, and refused where their hardware differs),
``verdicts`` (a run against a baseline: the statistics and the verdict rule), ``baseline``
(the store of baselines by hardware fingerprint), ``plan`` (``ComparePlan``: what the flags
ask for), ``output`` (the ``compare`` command's table, Markdown and JSON, and
``run_compare``, which ``run --compare-to`` calls too) and
``paired`` (the same-job gate's verdicts, paired by round). Never imports torch, and starts
no process: ``bench_lib.gate`` measures the gate's rounds and hands their folders here.
"""
