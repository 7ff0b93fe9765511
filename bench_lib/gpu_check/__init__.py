"""``benchmarks/gpu_check.py``'s parts: whether a GPU box's figures can be trusted.

folders.py (what a cuda run folder's rows and env.json must hold), sweeps.py (the sweeps it
runs, each measuring what it checks), shards.py (the test suite cut into shards by file, each
pinned to its own cores, and their results), collect_plugin.py (the pytest plugin that weighs
each collected test by its markers), verdict.py (the one verdict from all of them), plan.py
(what it runs on two GPUs or more, and its estimate).
"""
