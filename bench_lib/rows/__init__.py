"""A CASE'S ROWS: its cases.csv row and steps.csv rows (``rows``), their columns (the sampler's,
the bound's, the speedups'), its measured parts and bound (``case_parts``, ``case_bound``),
and a workload's rows from its launches so far (``workload_rows``)."""
