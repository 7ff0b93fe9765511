"""THE FILES of a run folder: the schema, writing and reading. Never imports torch."""
