"""PURE ARITHMETIC on figures: no torch, no device, no file.

``stats`` (intervals, the slowest rank per step), ``bubble`` (a pipeline's idle share,
measured from a timeline and in theory), ``bound`` (a case's bound from its parts),
``waterfall`` (where the ideal speedup goes) and ``collective_fits`` (the collectives'
latency-bandwidth fits). The runner fills cases.csv with them, the report and compare
read the same definitions; this package imports nothing of ``bench_lib`` but itself.
"""
