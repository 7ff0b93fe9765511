"""ONE LAUNCH OF A CASE = FRESH PROCESSES on this node: the typed protocol between the runner
and its ranks (``protocol``), the ranks started and combined (``ranks``), the code inside
them (``worker``, ``diagnostics``, the test-only ``faults``), torchrun (``torchrun``,
``agent``), the devices sampled (``sampling``) and the launch's fixed cost (``launch_parts``)."""
