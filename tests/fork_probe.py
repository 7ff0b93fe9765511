"""Run by tests/test_forkserver.py through the fork server: prints, as JSON, what a forked
rank inherits that the tests check: the objects the server froze out of the collector's
reach, and whether CUDA can start here (torch refuses it in a child forked from a process
that had started it: ``_is_in_bad_fork``; a GPU box then starts it for real)."""

import gc
import json

import torch

found = {"frozen": gc.get_freeze_count(), "bad_fork": torch.cuda._is_in_bad_fork()}
if torch.cuda.is_available():
    torch.cuda.init()
    found["cuda_initialised"] = torch.cuda.is_initialized()
print(json.dumps(found))
