"""env.json's hardware fingerprint, read: its hardware keys (``hardware_of``) and their short
id (``fingerprint_id``). ``compare`` files and finds a stored baseline by the id, ``run.merge``
refuses shards of different hardware by it, and a calibration reused by a later run must
name the same (``prediction.calibration_file.hardware_id``). Never imports torch.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

SOFTWARE_KEYS = ("torch", "torchvision", "cuda", "cudnn", "nccl", "driver", "python")
"""env.json ``versions`` that differ between runs without making them different hardware:
reported beside the verdict, never a reason to refuse one."""


def hardware_of(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """A fingerprint's hardware keys: without the software ones that env.json files written
    before the fingerprint named hardware only still carry (torch, driver)."""
    return {k: v for k, v in fingerprint.items() if k not in SOFTWARE_KEYS}


def fingerprint_id(fingerprint: dict[str, Any]) -> str:
    """A short stable id of a hardware fingerprint (a stored baseline's folder name).

    Of its hardware keys only (``hardware_of``): runs that differ in torch or driver
    version share an id, so a torch upgrade is gated against the baseline of its hardware.
    """
    text = json.dumps(hardware_of(fingerprint), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]
