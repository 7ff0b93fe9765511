"""ONE CASE = FRESH PROCESSES: the runner, the worker, the typed protocol between them,
the case's row, progress, and the test-only fault hooks."""
