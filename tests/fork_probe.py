"""Run by tests/test_forkserver.py through the fork server: prints what a forked rank
inherits that a test checks (the objects the server froze out of the collector's reach)."""

import gc

print(gc.get_freeze_count())
